"""replay: what a GRPO round trains on besides its own fresh rollouts (axolotl's replay buffer and re-roll).

A group is the num_generations completions of one prompt in one round. A group has *signal* when
some completion's advantage is nonzero (|A| >= 1e-8); a group without it (all rewards equal)
trains nothing.

Replay buffer (`grpo.replay_buffer_size` > 0): every group with signal is cached with the score
sum(|A|) * std(reward) of its rows; the buffer keeps the `replay_buffer_size` highest scores (ties:
the newer group). In each later round, the round's zero-signal groups are replaced, in order, by
distinct cached groups drawn with probability proportional to their score (seeded by grpo.seed and
the round). A replayed group keeps its rows as scored in its own round (completion, rewards,
advantage, rollout_id, round_index) and is marked `replayed`. Entries stay in the buffer after being
replayed. A round never replays its own groups: the buffer holds earlier rounds only.

Re-roll (`grpo.reroll_start_fraction` < 1): a group where every completion failed (every reward of
every function is 0 and none has signal) queues its prompt. From round max(1, int(rounds *
reroll_start_fraction)) on, each round's rollout takes up to `reroll_max_groups` prompts from the front
of the queue and samples them in place of the last prompts of its slice (rows marked `rerolled`). A
re-rolled prompt that fails again is queued again. With async prefetch, a round's rollout sees the
failures of the rounds scored before it was submitted.

Both are state carried across rounds; `RoundSignals` holds it and is rebuilt from the scored tables
on every run (a resumed run replays the same cached rounds into the same state), so the choices, and
the artifact keys that record them, are the same on every rerun.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages.data.schemas import REPLAYED, write_table
from stages.scoring.advantages import ZERO_ADVANTAGE
from stages.training.scope_rl import AUX_COLUMN

FAILED_REWARD = 1e-6  # |reward| below this counts as a failure for re-roll (axolotl's test)


@dataclass(frozen=True)
class GroupSignal:
    """One prompt's completions in one scored round."""

    prompt_id: str
    has_signal: bool
    all_failed: bool
    score: float  # sum(|advantage|) * std(reward): how much the group teaches


@dataclass(frozen=True)
class CachedGroup:
    """A group with signal, as the replay buffer keeps it: where its rows are and how it scores."""

    source_path: Path  # the scored parquet that holds its rows
    source_key: str  # that artifact's "<stage>/<key>", for the replay artifact's key and lineage
    round_index: int
    prompt_id: str
    score: float


@dataclass(frozen=True)
class Replacement:
    """A zero-signal group of this round (replaced_prompt_id) swapped for a cached group."""

    replaced_prompt_id: str
    group: CachedGroup

    def as_key(self) -> list:
        return [self.replaced_prompt_id, self.group.source_key, self.group.prompt_id]


def group_signals(rows: list[dict]) -> list[GroupSignal]:
    """Each prompt's group in a scored table (rows with `rewards`, `reward`, `advantage`), in order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["prompt_id"], []).append(row)
    out = []
    for prompt_id, members in groups.items():
        has_signal = any(abs(r["advantage"]) >= ZERO_ADVANTAGE for r in members)
        values = [v for r in members for _, v in r["rewards"] if v is not None]
        all_failed = not has_signal and bool(values) and all(abs(v) < FAILED_REWARD for v in values)
        totals = [r["reward"] for r in members]
        spread = statistics.pstdev(totals) if len(totals) > 1 else 0.0
        out.append(GroupSignal(prompt_id, has_signal, all_failed,
                               sum(abs(r["advantage"]) for r in members) * spread))
    return out


class ReplayBuffer:
    """The `size` highest-scoring groups with signal seen so far (ties: the newer one)."""

    def __init__(self, size: int):
        self.size = size
        self.groups: list[CachedGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[CachedGroup]) -> None:
        # newest first, then a stable sort by score: equal scores keep the newer group ahead
        merged = sorted(list(reversed(groups)) + self.groups, key=lambda g: -g.score)
        self.groups = merged[: self.size]

    def draw(self, k: int, rng: random.Random) -> list[CachedGroup]:
        """Up to k distinct groups, each drawn with probability proportional to its score
        (weighted sampling without replacement: the k largest u ** (1 / score))."""
        keyed = sorted(self.groups, key=lambda g: -(rng.random() ** (1.0 / max(g.score, 1e-12))))
        return keyed[:k]


class RoundSignals:
    """Replay buffer and re-roll queue across a run's rounds (module docstring)."""

    def __init__(self, replay_buffer_size: int, reroll_start_round: int | None, reroll_max_groups: int,
                 seed: int):
        self.buffer = ReplayBuffer(replay_buffer_size) if replay_buffer_size else None
        self.reroll_start_round = reroll_start_round  # None: re-roll off
        self.reroll_max_groups = reroll_max_groups
        self.reroll_queue: deque[str] = deque()
        self.seed = seed

    @classmethod
    def from_config(cls, grpo_cfg, rounds: int) -> RoundSignals | None:
        """The state for these grpo options, or None when neither replay nor re-roll is on."""
        start = reroll_start_round(grpo_cfg.reroll_start_fraction, rounds)
        if not grpo_cfg.replay_buffer_size and start is None:
            return None
        return cls(grpo_cfg.replay_buffer_size, start, grpo_cfg.reroll_max_groups, grpo_cfg.seed)

    def prompts_to_reroll(self, round_index: int) -> list[str]:
        """Take the prompts round `round_index` re-rolls from the front of the queue ([] before the start)."""
        if self.reroll_start_round is None or round_index < self.reroll_start_round:
            return []
        return [self.reroll_queue.popleft() for _ in range(min(self.reroll_max_groups, len(self.reroll_queue)))]

    def after_scoring(self, round_index: int, scored_path: Path, source_key: str) -> list[Replacement]:
        """Take in round `round_index`'s scored table: return the replacements for its zero-signal groups
        (from earlier rounds' groups), then cache its groups with signal and queue its failed prompts."""
        aux = [AUX_COLUMN] if AUX_COLUMN in pq.read_schema(scored_path).names else []
        rows = pq.read_table(scored_path, columns=["prompt_id", "rewards", "reward", "advantage", *aux]).to_pylist()
        rows = [r for r in rows if not r.get(AUX_COLUMN)]  # SCOPE-RL's groups: not replaced, cached nor re-rolled
        signals = group_signals(rows)
        replacements = []
        if self.buffer is not None:
            empty = [s.prompt_id for s in signals if not s.has_signal]
            drawn = self.buffer.draw(len(empty), random.Random(self.seed * 100_003 + round_index))
            replacements = [Replacement(p, g) for p, g in zip(empty, drawn)]
            self.buffer.add([CachedGroup(Path(scored_path), source_key, round_index, s.prompt_id, s.score)
                             for s in signals if s.has_signal])
        if self.reroll_start_round is not None:
            self.reroll_queue.extend(s.prompt_id for s in signals
                                     if s.all_failed and s.prompt_id not in self.reroll_queue)
        return replacements

    def metrics(self, replaced: int, rerolled: int) -> dict:
        """A round's metrics: groups it replayed, prompts it re-rolled, and the state after it."""
        out = {}
        if self.buffer is not None:
            out.update({"replay/replaced_groups": replaced, "replay/buffer_size": len(self.buffer)})
        if self.reroll_start_round is not None:
            out.update({"reroll/rerolled_prompts": rerolled, "reroll/queue_size": len(self.reroll_queue)})
        return out


def reroll_start_round(fraction: float, rounds: int) -> int | None:
    """The first round that re-rolls (axolotl: max(1, int(total * fraction))); None when fraction >= 1."""
    return None if fraction >= 1.0 else max(1, int(rounds * fraction))


def run(scored_path: Path, replacements: list[Replacement], round_index: int, out_dir: Path) -> dict:
    """Write out_dir/scored.parquet: round `round_index`'s scored rows with each replaced group's rows
    swapped, in place, for its cached group's rows (as scored in their own round, `replayed` true)."""
    table = pq.read_table(scored_path)
    sources: dict[Path, list[dict]] = {}  # each earlier round's table read once
    by_replaced = {}
    for rep in replacements:
        path, prompt_id = rep.group.source_path, rep.group.prompt_id
        if path not in sources:
            sources[path] = pq.read_table(path).to_pylist()
        found = [r for r in sources[path] if r["prompt_id"] == prompt_id and not r.get(AUX_COLUMN)]
        if not found:
            raise ValueError(f"replay: {path} has no rows of prompt {prompt_id!r} "
                             f"(cached from round {rep.group.round_index})")
        by_replaced[rep.replaced_prompt_id] = found
    out, done = [], set()
    for row in table.to_pylist():
        pid = row["prompt_id"]
        if pid not in by_replaced or row.get(AUX_COLUMN):  # (SCOPE-RL's auxiliary rows stay as they are)
            out.append({**row, "replayed": False})
        elif pid not in done:
            done.add(pid)
            out.extend({**{c: r.get(c) for c in table.column_names}, "replayed": True} for r in by_replaced[pid])
    missing = set(by_replaced) - done
    if missing:
        raise ValueError(f"replay: {scored_path} has no group for prompt(s) {sorted(missing)} to replace")
    schema = table.schema.append(pa.field("replayed", pa.bool_()))
    write_table(pa.Table.from_pylist(out, schema=schema), out_dir / "scored.parquet", REPLAYED, extra_ok=True)
    ages = [round_index - r["round_index"] for r in out if r["replayed"]]
    return {"rows": len(out), "replaced_groups": len(replacements), "replayed_rows": len(ages),
            "replay_age_rounds_mean": sum(ages) / len(ages) if ages else 0.0}
