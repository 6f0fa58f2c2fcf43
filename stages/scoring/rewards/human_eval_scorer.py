"""The `human_eval` reward: a HumanEval problem's own unit tests (`check(candidate)`) run on a completion, in the
code sandbox of `code_execution` (stages/scoring/rewards/sandbox.py: its isolation, limits and timeouts).

Rows of a `path: human_eval` source (stages/data/human_eval_source.py) carry a `human_eval` column, the JSON record
of their problem: task_id, prompt (imports, signature, docstring), test (which defines `check`) and entry_point.
The program is the problem's prompt followed by the completion's code, as HumanEval builds it
(human_eval/execution.py: prompt + completion + test + `check(entry_point)`):

- a completion with a ```python block (the last one; else the last untagged block) that defines the entry point:
  the prompt, then the block (the prompt's imports and helpers stay; the block's function replaces the stub);
- a block without that definition: the function's body, appended to the prompt;
- no block: the raw completion appended to the prompt (HumanEval's own completion convention).

A completion is 1.0 when the tests pass, else 0.0 as a `Verdict` naming why (the assertion or exception, a refused
os.system or import, the CPU or wall-clock limit, a crash): the row's `errors` column shows it, and it is a
verdict, not a failure of the reward (score.max_error_rate does not count it). A row whose record cannot be read is
a SampleError.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

from stages.scoring.rewards.common import SampleError, Verdict, completion_text
from stages.scoring.rewards.sandbox import DEFAULT_LIMITS, SandboxLimits, extract_code, run_tests_explained


def program(problem: dict, completion: str) -> str:
    """The program HumanEval runs for a completion of `problem` ({prompt, entry_point}): see the module docstring.

    >>> p = {"prompt": "def inc(x):\\n    \\"\\"\\"x + 1\\"\\"\\"\\n", "entry_point": "inc"}
    >>> print(program(p, "    return x + 1"))
    def inc(x):
        \"\"\"x + 1\"\"\"
        return x + 1
    >>> print(program(p, "Sure:\\n```python\\ndef inc(x):\\n    return x + 1\\n```"))
    def inc(x):
        \"\"\"x + 1\"\"\"
    <BLANKLINE>
    def inc(x):
        return x + 1
    """
    code = extract_code(completion, strip=False)
    if code == completion.rstrip():  # no code block: the completion continues the prompt
        return problem["prompt"] + completion
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return problem["prompt"] + "\n" + code.strip("\n")
    return problem["prompt"] + code.strip("\n")


def check(problem: dict) -> str:
    """The test that runs in the program's namespace: the problem's `check` and its call on the entry point."""
    return f"{problem['test']}\ncheck({problem['entry_point']})\n"


def human_eval_reward(prompts=None, completions=None, *, human_eval, limits: SandboxLimits = DEFAULT_LIMITS,
                      **kwargs) -> list[float]:
    """1.0 where the completion passes its problem's tests (in the sandbox, `limits`), else a 0.0 Verdict naming
    why; a SampleError where the row's `human_eval` record cannot be read.

    >>> from stages.data.human_eval_source import rows
    >>> row = rows()[53]  # HumanEval/53: add(x, y)
    >>> human_eval_reward(completions=["    return x + y\\n", "    return x - y\\n"], human_eval=[row["human_eval"]] * 2)
    [1.0, 0.0]
    """
    if len(human_eval) != len(completions):
        raise ValueError(f"human_eval: {len(completions)} completions but {len(human_eval)} rows")

    def score(job) -> float | SampleError:
        completion, record = job
        try:
            problem = json.loads(record)
            code, test = program(problem, completion_text(completion)), check(problem)
        except (TypeError, KeyError, json.JSONDecodeError) as e:
            return SampleError(f"human_eval: the row's record cannot be read ({type(e).__name__}: {e})")
        why = run_tests_explained(code, [test], limits)[0]
        return 1.0 if why is None else Verdict(0.0, f"{problem['task_id']} fails its tests: {why}")

    with ThreadPoolExecutor(max_workers=max(1, min(limits.workers, len(completions)))) as pool:
        return list(pool.map(score, zip(completions, human_eval)))
