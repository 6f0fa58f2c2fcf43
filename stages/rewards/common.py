"""Helpers shared by reward functions."""


def completion_text(completion) -> str:
    """The text of a completion given as a string or as a list of chat messages.

    >>> completion_text([{"role": "assistant", "content": "hi"}])
    'hi'
    """
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")
