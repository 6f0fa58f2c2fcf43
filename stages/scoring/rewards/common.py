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


class Verdict(float):
    """A reward value with the reason behind it (a program's failing test, the limit that killed it): scored as the
    number, and `why` goes in the sample's `errors` entry as `<function>: <why>`. Not a failure of the function:
    it does not count toward score.max_error_rate, nor get reward_on_error.

    >>> v = Verdict(0.0, "AssertionError"); v == 0.0, v.why
    (True, 'AssertionError')
    """

    def __new__(cls, value: float, why: str):
        verdict = super().__new__(cls, value)
        verdict.why = why
        return verdict

    def __reduce__(self):  # to and from the reward workers (pickle)
        return Verdict, (float(self), self.why)
