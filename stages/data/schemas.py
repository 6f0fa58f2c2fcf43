"""Parquet schemas shared by every stage, defined once.

Anyone can read the tables with pandas, polars, duckdb or
`datasets.load_dataset("parquet", data_files=...)`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

# transform -> prompts.parquet. Extra passthrough columns (e.g. `answer`) follow these.
PROMPTS = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("answer", pa.string()),
    ]
)

# rollout -> rollouts.parquet: one row per completion.
ROLLOUTS = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("group_index", pa.int32()),  # which of the num_generations completions of the prompt
        ("prompt", pa.list_(MESSAGE)),
        ("completion", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("sampling_logprobs", pa.list_(pa.float32())),  # log pi(token) under logits / temperature
        ("round_index", pa.int32()),  # the round these completions train
        ("policy_version", pa.int32()),  # 0 = base policy, v = after v optimize rounds; staleness = round - version
        ("engine", pa.string()),  # transformers | vllm | vllm_server, or "<engine>+<rollout_func>"
        ("finish_reason", pa.string()),  # "stop" (EOS generated) or "length"
        ("rerolled", pa.bool_()),  # the prompt was re-queued after all its completions failed
        # (stages/scoring/replay.py)
    ]
)

# score -> scored.parquet: rollouts columns + these.
SCORED_EXTRA = [
    ("rewards", pa.map_(pa.string(), pa.float64())),  # per reward function name
    ("reward", pa.float64()),  # weighted total
    ("advantage", pa.float64()),
    ("errors", pa.list_(pa.string())),  # "<reward function>: <what failed>" per reward_on_error; [] when fine
]
SCORED = pa.schema(list(ROLLOUTS) + [pa.field(n, t) for n, t in SCORED_EXTRA])

# replay -> scored.parquet: what a round trains on when the replay buffer swapped groups in (stages/scoring/replay.py).
REPLAYED = pa.schema(list(SCORED) + [pa.field("replayed", pa.bool_())])  # rows of an earlier round's group

# preferences -> <split>.parquet: one schema for every kind of preference row (see stages/data/preferences.py).
PREFERENCES = pa.schema(
    [
        ("pair_id", pa.string()),  # "<split>-<raw row index>", "<split>-<source>-<raw row index>" with several sources
        ("kind", pa.string()),  # "pair" | "unpaired" | "stepwise"
        ("prompt", pa.list_(MESSAGE)),
        ("chosen", pa.list_(MESSAGE)),  # pair: the preferred assistant turn(s)
        ("rejected", pa.list_(MESSAGE)),  # pair: the dispreferred assistant turn(s)
        ("completion", pa.list_(MESSAGE)),  # unpaired: the assistant turn(s)
        ("label", pa.bool_()),  # unpaired: True = desirable
        ("completions", pa.list_(pa.string())),  # stepwise: one string per reasoning step
        ("labels", pa.list_(pa.bool_())),  # stepwise: one label per step
    ]
)


def write_table(rows_or_table, path: Path, schema: pa.Schema, extra_ok: bool = False) -> pa.Table:
    """Write rows (list of dicts) or a table as Parquet, cast to `schema`.

    With `extra_ok`, columns not in the schema are kept after the schema's columns
    (passthrough columns of the prompts table).
    """
    table = rows_or_table if isinstance(rows_or_table, pa.Table) else pa.Table.from_pylist(rows_or_table)
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"{path.name}: missing columns {missing} for schema")
    fields = list(schema)
    if extra_ok:
        fields += [table.schema.field(n) for n in table.column_names if n not in schema.names]
    target = pa.schema(fields)
    table = table.select(target.names).cast(target)
    pq.write_table(table, path)
    return table


def read_rows(path: Path) -> list[dict]:
    """The rows of a Parquet table this pipeline wrote (the preferences table, ...), as dicts."""
    return pq.read_table(path).to_pylist()
