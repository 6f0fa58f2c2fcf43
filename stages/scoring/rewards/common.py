"""Helpers shared by reward functions."""


class SampleError(Exception):
    """What a reward function returns in place of a value for a sample it could not score: that sample
    gets `reward_on_error` and this message in its `errors` entry; the batch's other samples keep theirs."""


def completion_text(completion) -> str:
    """The text of a completion given as a string or as a list of chat messages.

    >>> completion_text([{"role": "assistant", "content": "hi"}])
    'hi'
    """
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")
