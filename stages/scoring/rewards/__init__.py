"""Built-in reward functions with TRL's signature: fn(prompts, completions, **columns) -> list[float].

`completions` are chat message lists for chat prompts (as in TRL) or plain strings.
Config names them by key (`accuracy`, `stated_accuracy`, `format`, `code_execution`); user functions are `module.fn`.
"""

from stages.scoring.rewards.common import completion_text
from stages.scoring.rewards.math import accuracy_reward, format_reward, stated_accuracy_reward
from stages.scoring.rewards.sandbox import code_execution

BUILTIN_REWARDS = {"accuracy": accuracy_reward, "stated_accuracy": stated_accuracy_reward, "format": format_reward,
                   "code_execution": code_execution}

__all__ = ["BUILTIN_REWARDS", "accuracy_reward", "stated_accuracy_reward", "format_reward", "code_execution",
           "completion_text"]

