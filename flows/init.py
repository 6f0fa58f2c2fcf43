"""`posttrain init DIR`: a new task that runs as it is: DIR/config.yaml, five rows in DIR/data.jsonl and a reward
function in DIR/rewards.py (TRL's signature). The config builds a tiny model here (no download, about a minute
on a CPU); put your rows, your reward and model.path in, and `posttrain validate` says what a run would trip on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROWS = [{"question": "What is 2 + 3?", "answer": "5"},
        {"question": "What is 7 - 4?", "answer": "3"},
        {"question": "What is 3 * 3?", "answer": "9"},
        {"question": "What is 8 / 2?", "answer": "4"},
        {"question": "What is 6 + 1?", "answer": "7"}]
"""The five rows of data.jsonl: question and answer, what transform.type question_answer reads."""

REWARDS = '''"""Reward functions of {name}, TRL's signature: fn(prompts, completions, **columns) -> one float per completion.

`completions` are chat messages ([{{"role": "assistant", "content": ...}}]); the keyword arguments are the rows'
columns (`answer`, ...), `completion_ids` and `prompt_id`. posttrain finds this module beside the config.
"""

import re


def correct(prompts, completions, answer, **columns):
    """1.0 where the last number of the completion is the row's answer, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", text)
        scores.append(1.0 if numbers and numbers[-1] == gold else 0.0)
    return scores
'''

CONFIG = """# {name}: GRPO on your own rows with your own reward function (written by `posttrain init`).
# As it is, it builds a tiny model here and runs two rounds in about a minute on a CPU:
#   posttrain validate {config}     # what a run would trip on, in seconds
#   posttrain run {config}
# Then make it yours: your rows in {data} (question/answer columns, or set transform.type), your
# reward in {rewards} (TRL's signature), and a real model (uncomment model.path; drop the sizes).
name: {name}
artifacts_dir: artifacts

transform:
  paths: {{train: {data}, eval: {data}}}   # relative to the folder you run posttrain from
  type: question_answer

model:
  # path: HuggingFaceTB/SmolLM2-135M-Instruct   # a hub id, a local folder or a .gguf file
  hidden_size: 64              # the sizes of a tiny model built here (remove them with model.path)
  num_attention_heads: 1
  num_key_value_heads: 1
  intermediate_size: 128
  num_hidden_layers: 2
  vocab_size: 300

# No sft section: your model goes straight to GRPO (sft.enabled: true with sft.completion_field warm-starts it).

rollout:
  num_generations: 4
  prompts_per_round: 4
  max_completion_length: 16

score:
  reward_funcs: [rewards.correct, format]   # rewards.py beside this config; `format` is built in
  reward_weights: [1.0, 0.1]
  reward_num_workers: 1

grpo:
  rounds: 2
  micro_batch_size: 16

eval:
  max_completion_length: 16
"""


def add_arguments(parser):
    parser.add_argument("folder", help="the task's new folder, e.g. my-task (its name is the config's name)")
    parser.add_argument("--force", action="store_true", help="overwrite the files if the folder has them")
    return parser


def init_command(args) -> int:
    folder = Path(args.folder)
    try:
        paths = write_task(folder, force=args.force)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = paths["config"]
    print(f"wrote {', '.join(str(p) for p in paths.values())}\n"
          f"next: posttrain validate {config} && posttrain run {config}")
    return 0


def write_task(folder: Path, force: bool = False) -> dict[str, Path]:
    """Write config.yaml, data.jsonl and rewards.py into `folder` (created); the config names the data by its
    path relative to the working folder. Refuses to overwrite unless `force`."""
    name = folder.resolve().name
    paths = {"config": folder / "config.yaml", "data": folder / "data.jsonl", "rewards": folder / "rewards.py"}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; pass --force to overwrite, or pick another folder")
    folder.mkdir(parents=True, exist_ok=True)
    data = os.path.relpath(paths["data"])
    paths["data"].write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    paths["rewards"].write_text(REWARDS.format(name=name))
    paths["config"].write_text(CONFIG.format(name=name, config=os.path.relpath(paths["config"]), data=data,
                                             rewards=os.path.relpath(paths["rewards"])))
    return paths
