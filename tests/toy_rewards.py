"""Toy reward functions for tests (importable by spawned reward workers via sys.path)."""


def letters(prompts=None, completions=None, **kwargs):
    """Fraction of the completion's characters that are lowercase ASCII letters."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum("a" <= ch <= "z" for ch in t) / max(len(t), 1) for t in texts]


def by_prompt(completions=None, completion_ids=None, prompt_id=None, **kwargs):
    """Set by the prompt id `<split>-<n>`: n % 3 == 0 always fails (0), n % 3 == 1 always succeeds (1),
    n % 3 == 2 scores the parity of the completion's token-id sum (the group usually has signal)."""
    out = []
    for pid, ids in zip(prompt_id, completion_ids):
        kind = int(pid.rsplit("-", 1)[1]) % 3
        out.append(0.0 if kind == 0 else 1.0 if kind == 1 else float(sum(ids) % 2))
    return out


def local_rank(completions=None, **kwargs):
    """The LOCAL_RANK of the worker process that scores (which GPU a reward model there would take)."""
    import os
    import time

    time.sleep(0.2)  # long enough that both workers of a pool take a job
    return [float(os.environ.get("LOCAL_RANK", "-1"))] * len(completions)
