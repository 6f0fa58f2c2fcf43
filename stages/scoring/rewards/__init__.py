"""Built-in reward functions with TRL's signature: fn(prompts, completions, **columns) -> list[float].

`completions` are chat message lists for chat prompts (as in TRL) or plain strings.
Config names them by key (`accuracy`, `stated_accuracy`, `format`, `code_execution`, `reasoning_gym`, `human_eval`);
user functions are `module.fn`.
"""

from stages.scoring.rewards.common import completion_text
from stages.scoring.rewards.human_eval_scorer import human_eval_reward
from stages.scoring.rewards.math import accuracy_reward, format_reward, stated_accuracy_reward
from stages.scoring.rewards.reasoning_gym_scorer import reasoning_gym_reward
from stages.scoring.rewards.sandbox import code_execution

BUILTIN_REWARDS = {"accuracy": accuracy_reward, "stated_accuracy": stated_accuracy_reward, "format": format_reward,
                   "code_execution": code_execution, "reasoning_gym": reasoning_gym_reward,
                   "human_eval": human_eval_reward}
TASK_VERIFIERS = ("reasoning_gym", "human_eval")
"""Built-ins that are a task's own verifier (its authors' scorer): the eval judges with them when the run's
score.reward_funcs names them, as it does with your own functions (stages/evaluation/evaluate.py verifier_funcs)."""

__all__ = ["BUILTIN_REWARDS", "TASK_VERIFIERS", "accuracy_reward", "stated_accuracy_reward", "format_reward",
           "code_execution", "reasoning_gym_reward", "human_eval_reward", "completion_text"]

