"""What a stage cost, and what a run cost: the manifest's `cost` record and the run summary's totals.

Every computed stage's manifest holds `cost` (tasks/stage_tasks.py `materialize` measures it around the stage call):

    {"wall_s": float, "cpu_s": float, "gpu_s": float | None, "gpu_peak_bytes": int | None,
     "tokens_generated": int | None, "tokens_trained": int | None, "tokens_scored": int | None}

What is counted (`Meter`):

- wall_s: seconds of the stage call (the stage function, or its runner: the rollout worker, torchrun ranks).
- cpu_s: CPU seconds (user + system) of
  1. the thread that called the stage, exactly (its own CPU clock);
  2. this process's other threads while the stage ran (torch/OpenMP intra-op workers, tokenizer threads, Prefect
     and MLflow threads) -- the process's CPU less the stage threads' own;
  3. this process's child processes and their descendants while the stage ran: live ones by their CPU clocks
     (psutil), exited ones once a parent reaps them (a descendant's reaped children, this process's
     RUSAGE_CHILDREN). That takes in reward worker pools, the rollout worker process, torchrun ranks (warm ranks
     too: their CPU between two stages, while idle, is no stage's), a local Ray instance's workers, vLLM engines
     started here.
  Stages run at once in one process (rollout.async_prefetch samples beside optimize in Prefect's threads):
  each gets 1 exactly, and the process tree of a worker it claims (`claim`: the rollout worker process, its
  engines included) exactly; the rest of 2 and 3, which no clock ties to one stage, is settled per interval
  between two stage starts or ends (`_Ledger`): 2 in proportion to each stage thread's own CPU in the interval
  (the intra-op workers run for the thread driving torch; evenly when no stage thread used any), 3 evenly.
  The run total is exact; one stage's share of 2 and the unclaimed part of 3 under concurrency is an
  estimate, not a measurement. CPU spent while no stage runs (the flow itself, MLflow and Prefect between
  stages, imports before the first stage) is in no stage.
  Not counted: processes this one did not start or that left its tree (a Ray cluster started by `ray start`,
  remote vLLM servers, remote verifiers, orphaned grandchildren), and a child's CPU between its last reading and
  its exit when no living ancestor reaps it.
- gpu_s, gpu_peak_bytes: CUDA in this process, through torch: per interval, its wall seconds times the devices
  holding memory allocated by this process (torch.cuda.max_memory_allocated since the last reset > 0), split
  evenly among the stages running at once; the peak is the largest torch.cuda.max_memory_allocated of a device
  while the stage ran (the counters are reset at every stage start and end: under concurrency it is the
  process's peak, other stages' tensors included). None where CUDA was never initialized in this process by
  the stage's end (a CPU run). GPU work in other processes (torchrun ranks, a rollout worker process, vLLM) is
  not seen here.
- tokens: from the stage's own output (`stage_tokens`): rollout: completion tokens in rollouts.parquet; score:
  completion tokens in scored.parquet; sft, dpo/ipo, optimize: the stage summary's `tokens_trained` (the
  non-padding input tokens, prompt and completion, its forward passes read, every pass counted: HF Trainer's
  `num_input_tokens_seen`, and GRPO's rows through forward/backward); None where a stage makes none of them or
  does not say (eval keeps no token ids; kto, orpo and simpo's trainers do not count theirs).

A stage read from the cache costs nothing in this run: `materialize` records its manifest's cost as avoided
(the stage's MLflow run: `cost_avoided_*` metrics, tag posttrain.cached; the run summary's `avoided`).

A run resumed after a kill reuses the stages that finished before it (avoided, not spent again); the stage the
kill cut off left no manifest, and the CPU, GPU and wall seconds it spent are lost with its process: counted
nowhere (its MLflow stage run is marked KILLED by the resume). A stage that continues from its checkpoint
(stages/runtime/checkpoints.py) records the seconds of the attempt that finished it, and its tokens are those of
its whole output (the trainer's restored token count).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

COST_FIELDS = ("wall_s", "cpu_s", "gpu_s", "gpu_peak_bytes", "tokens_generated", "tokens_trained", "tokens_scored")
SECONDS = ("wall_s", "cpu_s", "gpu_s")
TOKENS = ("tokens_generated", "tokens_trained", "tokens_scored")


def _tree_cpu(pid: int | None = None) -> float | None:
    """CPU seconds of a process tree, each living process's own and its reaped children's: the descendants of this
    process (pid None; with the children it reaped, RUSAGE_CHILDREN), or process `pid` and its descendants (None
    when it is gone)."""
    import psutil

    total = 0.0
    try:
        if pid is None:
            times = os.times()
            total, processes = times.children_user + times.children_system, psutil.Process().children(recursive=True)
        else:
            root = psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None if pid is not None else total
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.Error:  # gone since the listing
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _cuda():
    """torch.cuda if this process has initialized CUDA, else None (never initializes it)."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda if torch is not None and torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch
        return None


class Meter:
    """Measures one stage call (`with meter:` in the thread that makes it); `cost(...)` after it ends."""

    def __init__(self):
        self.ident = 0
        self.thread_last = 0.0
        self.cpu_s = 0.0
        self.gpu_s = 0.0
        self.gpu_peak = 0
        self.cuda = False
        self.started = self.ended = 0.0

    def __enter__(self) -> "Meter":
        self.ident = threading.get_ident()
        self.started = time.monotonic()
        _LEDGER.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        _LEDGER.exit(self)
        self.ended = time.monotonic()

    def cost(self, tokens: dict | None = None) -> dict:
        """The manifest's `cost` record (COST_FIELDS) of the measured call, with `tokens` (`stage_tokens`)."""
        return {"wall_s": round(self.ended - self.started, 3), "cpu_s": round(self.cpu_s, 3),
                "gpu_s": round(self.gpu_s, 3) if self.cuda else None,
                "gpu_peak_bytes": int(self.gpu_peak) if self.cuda else None,
                **{name: (tokens or {}).get(name) for name in TOKENS}}


class _Ledger:
    """Splits this process's CPU (and GPU time) among the meters running at once: at each meter's start and end
    (and claim), the interval since the last such event is settled (module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active: list[Meter] = []
        self.last = None  # (monotonic, process CPU, descendants' CPU) at the last event
        self.claims: dict[int, list[Meter]] = {}  # pid -> the meters whose stage that process tree works for
        self.claimed_last: dict[int, float] = {}  # pid -> its tree's CPU at the last event

    def _settle(self) -> None:
        now = (time.monotonic(), time.process_time(), _tree_cpu())
        cuda = _cuda()
        if self.last is None or not self.active:
            self.last = now
            if cuda is not None:
                self._reset_peaks(cuda)
            return
        wall, process, children = (a - b for a, b in zip(now, self.last))
        own = {}
        for meter in self.active:
            current = self._thread_cpu(meter)
            own[id(meter)] = max(0.0, current - meter.thread_last) if current is not None else 0.0
            meter.cpu_s += own[id(meter)]
            meter.thread_last = current if current is not None else meter.thread_last
        for pid, meters in list(self.claims.items()):  # claimed trees: their CPU is their stage's, not shared
            current = _tree_cpu(pid)
            if current is None:
                del self.claims[pid], self.claimed_last[pid]
                continue
            claimed = max(0.0, current - self.claimed_last[pid])
            self.claimed_last[pid] = current
            children -= claimed
            for meter in meters:
                meter.cpu_s += claimed / len(meters)
        threads = max(0.0, process - sum(own.values()))  # the process's other threads: by each stage thread's
        total_own = sum(own.values())  # own CPU (the intra-op workers of the thread that drives torch)
        for meter in self.active:
            weight = own[id(meter)] / total_own if total_own > 0 else 1 / len(self.active)
            meter.cpu_s += threads * weight + max(0.0, children) / len(self.active)
        devices_used, peak = 0, 0
        if cuda is not None:
            for device in range(cuda.device_count()):
                used = cuda.max_memory_allocated(device)
                devices_used += used > 0
                peak = max(peak, used)
            self._reset_peaks(cuda)
        for meter in self.active:
            if cuda is not None:
                meter.cuda = True
                meter.gpu_s += wall * devices_used / len(self.active)
                meter.gpu_peak = max(meter.gpu_peak, peak)
        self.last = now

    @staticmethod
    def _thread_cpu(meter: Meter) -> float | None:
        """The meter's thread's CPU clock (alive: it is inside its `with`)."""
        if meter.ident == threading.get_ident():
            return time.thread_time()
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(meter.ident))
        except (OSError, AttributeError, OverflowError):
            return None

    @staticmethod
    def _reset_peaks(cuda) -> None:
        for device in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(device)

    def enter(self, meter: Meter) -> None:
        with self.lock:
            self._settle()
            meter.thread_last = time.thread_time()
            self.active.append(meter)

    def exit(self, meter: Meter) -> None:
        with self.lock:
            self._settle()
            self.active.remove(meter)
            for pid, meters in list(self.claims.items()):
                if meter in meters:
                    meters.remove(meter)
                if not meters:
                    del self.claims[pid], self.claimed_last[pid]

    def claim(self, pid: int) -> None:
        with self.lock:
            meter = next((m for m in self.active if m.ident == threading.get_ident()), None)
            if meter is None:
                return
            self._settle()
            current = _tree_cpu(pid)
            if current is not None and meter not in self.claims.get(pid, []):
                self.claims.setdefault(pid, []).append(meter)
                self.claimed_last.setdefault(pid, current)


_LEDGER = _Ledger()


def claim(pid: int) -> None:
    """The process `pid` (and its descendants) works for the stage this thread is measuring: from now until that
    stage ends, their CPU is its own, not split among the stages running at once (the rollout worker process:
    tasks/stage_tasks.py rollout_task). Two stages claiming one process share it evenly."""
    _LEDGER.claim(pid)


def _completion_tokens(path: Path) -> int | None:
    """Completion tokens of a rollouts or scored table (its completion_token_ids' lengths), None if it has none."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if not path.is_file() or "completion_token_ids" not in pq.ParquetFile(path).schema_arrow.names:
        return None
    column = pq.read_table(path, columns=["completion_token_ids"]).column("completion_token_ids")
    return int(pc.sum(pc.list_value_length(column)).as_py() or 0)


def stage_tokens(stage: str, folder: Path, summary: dict) -> dict:
    """The tokens a stage's output says it generated, trained on or scored (module docstring)."""
    tokens = {}
    if stage == "rollout":
        tokens["tokens_generated"] = _completion_tokens(folder / "rollouts.parquet")
    if stage == "score":
        tokens["tokens_scored"] = _completion_tokens(folder / "scored.parquet")
    if isinstance(summary.get("tokens_trained"), (int, float)):
        tokens["tokens_trained"] = int(summary["tokens_trained"])
    return tokens


def recorded_cost(manifest: dict) -> dict:
    """A manifest's cost record; a manifest written before costs were recorded: its wall_time_s, the rest None."""
    cost = manifest.get("cost")
    if isinstance(cost, dict):
        return {name: cost.get(name) for name in COST_FIELDS}
    return {"wall_s": manifest.get("wall_time_s"), **{name: None for name in COST_FIELDS[1:]}}


def metrics(cost: dict, prefix: str) -> dict:
    """The numeric fields of a cost record as MLflow metrics `<prefix><field>` (None left out)."""
    return {f"{prefix}{name}": cost[name] for name in COST_FIELDS if isinstance(cost.get(name), (int, float))}


def _sum(records: list[dict], name: str):
    """The field's total over `records` (gpu_peak_bytes: the largest); wall and CPU seconds of no records: 0, any
    other field that none of them recorded: None."""
    values = [r[name] for r in records if isinstance(r.get(name), (int, float))]
    if not values:
        return 0.0 if name in ("wall_s", "cpu_s") else None
    if name == "gpu_peak_bytes":
        return max(values)
    return round(sum(values), 3) if name in SECONDS else int(sum(values))


def accepted_samples(rows: list[dict], root: Path) -> int | None:
    """Samples that trained the policy: for GRPO-family rounds, the rollouts with a nonzero advantage in the table
    each optimize round trained on (TRL's sense: a group whose rewards all tie gives its completions advantage 0,
    no gradient -- `frac_reward_zero_std`); for a DPO-family stage, the preference rows it trained on (its
    summary's train_rows). None when the run trained on neither."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total, found = 0, False
    for row in rows:
        manifest_path = Path(row["path"]) / "_manifest.json"
        if row["kind"] not in ("optimize", "dpo") or not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        if row["kind"] == "dpo" and isinstance(manifest["summary"].get("train_rows"), int):
            total, found = total + manifest["summary"]["train_rows"], True
        scored = manifest["inputs"].get("scored")
        table = root / scored / "scored.parquet" if scored else None
        if table is not None and table.is_file():
            advantage = pq.read_table(table, columns=["advantage"]).column("advantage")
            total += int(pc.sum(pc.not_equal(advantage, 0.0)).as_py() or 0)
            found = True
    return total if found else None


def run_totals(rows: list[dict], root: Path) -> dict:
    """The run summary's `cost`: `spent` (the stages this run computed), `avoided` (those it read from the
    cache: their manifests' cost), stage counts, accepted samples (`accepted_samples`), and the cost of the
    run's result (spent + avoided: what it took to make, whichever run paid) per 1k training tokens and per
    accepted sample, in wall, CPU and GPU seconds. `rows`: the Reporter's stage rows. Wall seconds are summed
    over stages: stages that ran at once (rollout.async_prefetch) overlap, so the total can exceed the run's
    elapsed time (`rounds_wall_s`, the MLflow run's duration); CPU and GPU seconds do not double count."""
    spent = [r["cost"] for r in rows if r["status"] == "computed" and r.get("cost")]
    avoided = [r["avoided"] for r in rows if r["status"] == "cached" and r.get("avoided")]
    totals = {"spent": {name: _sum(spent, name) for name in COST_FIELDS},
              "avoided": {name: _sum(avoided, name) for name in COST_FIELDS},
              "stages_computed": sum(r["status"] == "computed" for r in rows),
              "stages_cached": sum(r["status"] == "cached" for r in rows),
              "accepted_samples": accepted_samples(rows, root)}
    whole = {name: _sum([totals["spent"], totals["avoided"]], name) for name in (*SECONDS, *TOKENS)}
    trained, accepted = whole["tokens_trained"], totals["accepted_samples"]
    totals["per_1k_tokens_trained"] = {name: round(whole[name] * 1000 / trained, 6) if trained and whole[name]
                                       is not None else None for name in SECONDS}
    totals["per_accepted_sample"] = {name: round(whole[name] / accepted, 6) if accepted and whole[name]
                                     is not None else None for name in SECONDS}
    return totals


def totals_metrics(totals: dict) -> dict:
    """The parent run's cost/* metrics of `run_totals` (None left out)."""
    out = {**metrics(totals["spent"], "cost/"), **metrics(totals["avoided"], "cost/avoided_"),
           "cost/stages_computed": totals["stages_computed"], "cost/stages_cached": totals["stages_cached"]}
    if totals["accepted_samples"] is not None:
        out["cost/accepted_samples"] = totals["accepted_samples"]
    for per in ("per_1k_tokens_trained", "per_accepted_sample"):
        out.update({f"cost/{name}_{per}": v for name, v in totals[per].items() if v is not None})
    return out
