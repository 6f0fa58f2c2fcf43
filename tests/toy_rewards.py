"""Toy reward functions for tests (importable by spawned reward workers via sys.path)."""


def letters(prompts=None, completions=None, **kwargs):
    """Fraction of the completion's characters that are lowercase ASCII letters."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum("a" <= ch <= "z" for ch in t) / max(len(t), 1) for t in texts]
