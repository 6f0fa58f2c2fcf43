"""Two runs prompt by prompt on their shared held-out set (`posttrain diff`).

Reads what the runs wrote and recomputes nothing: each run's final eval artifact (`eval final`: eval.parquet, per
held-out prompt its completion, extracted answer, verifier reward and verdict; stages/evaluation/evaluate.py), its
base eval (`eval base`) for context, and each round's scored rollouts (`score rN`: scored.parquet). Runs are found
as `posttrain compare` finds them (flows/compare.py `resolve_runs`), so RUN is a run name or an MLflow run id.

It shows the verdicts that flipped (right->wrong, wrong->right) with both completions side by side, each run's
accuracy, verifier reward and most common answers, and per round each run's reward mean/std, per-function reward
means and completion length. Runs of any two methods compare; a run without rounds (DPO) has no round columns.
Runs evaluated on different prompts (ids, prompt text or gold answers) are an error: their verdicts do not pair up.

Loading (`load_*`, `diff_command_data`) reads MLflow and the artifact folders; the rest (`verdicts`, `diff_data`,
`diff_report`, ...) are pure functions of eval rows, testable on hand-built tables.

  posttrain diff RUN_A RUN_B [--artifacts DIR] [--json] [--limit N] [--html PATH]
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from flows.compare import (MISSING, CompareError, RunData, config_diff_rows, fmt_number, format_table, open_client,
                           resolve_runs)
from tasks.store import MANIFEST, ArtifactStore

FINAL, BASE = "eval final", "eval base"
ROUND_STAGE = re.compile(r"score r(\d+)")
FLIPS_SHOWN = 10  # per direction in the terminal, unless --limit
ANSWERS_SHOWN, ANSWERS_KEPT = 5, 20  # most common answers in the terminal / in --json
CONFIG_SHOWN = 12  # differing config keys in the terminal (`posttrain compare` lists them all)
COMPLETION_WIDTH = 40


@dataclass
class EvalTable:
    """One eval artifact of a run: its rows by prompt id, and what was asked and what judged them."""

    label: str
    rows: dict[str, dict]  # prompt_id -> eval.parquet row (completion, predicted_answer, reward, correct, ...)
    verifier: list[str] = field(default_factory=list)  # the reward functions that judged (manifest summary)
    asked: dict[str, str] = field(default_factory=dict)  # prompt_id -> digest of its prompt and gold answer
    path: str = ""


@dataclass
class Side:
    """What diff reads of one run: its final eval, its base eval if any, and its rounds' statistics."""

    run: RunData
    final: EvalTable
    base: EvalTable | None = None
    rounds: dict[int, dict] = field(default_factory=dict)  # round -> round_stats


# ---------------------------------------------------------------- pure functions of eval and scored rows

def asked_digest(prompt, answer) -> str:
    """What a held-out prompt asks, as a digest: its messages (when known) and its gold answer."""
    return hashlib.sha256(json.dumps([prompt, answer], sort_keys=True, default=str).encode()).hexdigest()[:16]


def shared_prompts(a: Side, b: Side) -> list[str]:
    """The prompt ids both final evals judged, in A's order; CompareError when the two eval sets differ (another id,
    or the same id with another prompt or gold answer)."""
    ids_a, ids_b = set(a.final.rows), set(b.final.rows)
    same = {p for p in ids_a & ids_b if a.final.asked.get(p) == b.final.asked.get(p)}
    if not ids_a == ids_b == same:
        raise CompareError(
            f"{a.run.name} and {b.run.name} were evaluated on different held-out prompts: {a.run.name} has "
            f"{len(ids_a)}, {b.run.name} has {len(ids_b)}, {len(same)} are the same in both (prompt id, prompt and "
            f"gold answer); diff pairs verdicts prompt by prompt, so both runs need one eval set")
    return list(a.final.rows)


def verdict(table: EvalTable | None, prompt_id: str) -> bool | None:
    """Whether the eval judged the prompt's completion correct; None without that eval or row."""
    row = table.rows.get(prompt_id) if table else None
    return None if row is None else bool(row["correct"])


def verdicts(a: Side, b: Side, ids: list[str]) -> dict:
    """The shared prompts' verdict pairs: counts of both right / both wrong, and each flip (right_to_wrong: A right,
    B wrong; wrong_to_right: A wrong, B right) with both completions, answers, rewards and the base verdicts."""
    out = {"both_right": 0, "both_wrong": 0, "right_to_wrong": [], "wrong_to_right": []}
    for pid in ids:
        ra, rb = a.final.rows[pid], b.final.rows[pid]
        right_a, right_b = verdict(a.final, pid), verdict(b.final, pid)
        if right_a == right_b:
            out["both_right" if right_a else "both_wrong"] += 1
            continue
        out["right_to_wrong" if right_a else "wrong_to_right"].append({
            "prompt_id": pid, "gold": ra.get("answer"), "completions": [ra["completion"], rb["completion"]],
            "answers": [answer_of(ra), answer_of(rb)], "rewards": [ra.get("reward"), rb.get("reward")],
            "base_correct": [verdict(a.base, pid), verdict(b.base, pid)]})
    return out


def answer_of(row: dict) -> str:
    """The row's extracted answer (eval.parquet `predicted_answer`; else extracted from its completion)."""
    if row.get("predicted_answer") is not None:
        return row["predicted_answer"]
    from stages.scoring.rewards.math import extract_answer

    return extract_answer(row.get("completion") or "")


def answer_distribution(rows: list[dict], keep: int = ANSWERS_KEPT) -> dict:
    """How many distinct answers the completions give and the `keep` most common, [[answer, count], ...].

    >>> answer_distribution([{"predicted_answer": "7"}, {"predicted_answer": "7"}, {"predicted_answer": "3"}])
    {'distinct': 2, 'top': [['7', 2], ['3', 1]]}
    """
    counts = Counter(answer_of(r) for r in rows)
    return {"distinct": len(counts), "top": [[answer, n] for answer, n in counts.most_common(keep)]}


def mean(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def reward_means(table: EvalTable) -> dict[str, float | None]:
    """Mean reward per verifier function over the eval rows: per function where rows carry a `rewards` map, else
    the rows' `reward` (the mean of the verifier's functions) under the verifier's name(s)."""
    rows = list(table.rows.values())
    if rows and isinstance(rows[0].get("rewards"), (dict, list)):
        per_row = [dict(r["rewards"] or {}) for r in rows]
        return {fn: mean(r.get(fn) for r in per_row) for fn in sorted(set().union(*per_row))}
    return {" + ".join(table.verifier) or "reward": mean(r.get("reward") for r in rows)}


def round_stats(rows: list[dict]) -> dict:
    """One round's scored rollouts: reward mean and std over its completions (the score stage's reward_mean and
    reward_std_batch), mean reward per function, and completion length mean in tokens."""
    rewards = [float(r["reward"]) for r in rows if r.get("reward") is not None]
    per_row = [dict(r.get("rewards") or {}) for r in rows]
    return {"samples": len(rows), "reward_mean": mean(rewards),
            "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else None,
            "rewards": {fn: mean(r.get(fn) for r in per_row) for fn in sorted(set().union(*per_row))},
            "length_mean": mean(len(r.get("completion_token_ids") or ()) for r in rows)}


def accuracy(table: EvalTable | None) -> float | None:
    return mean(r["correct"] for r in table.rows.values()) if table else None


def diff_data(a: Side, b: Side, limit: int | None = None) -> dict:
    """Everything `posttrain diff` shows, as one JSON-ready dict (`--json` prints it; `diff_report` renders it).
    `limit`: flips kept per direction (None: all)."""
    ids = shared_prompts(a, b)
    flips = verdicts(a, b, ids)
    runs = []
    for side in (a, b):
        rows = [side.final.rows[p] for p in ids]
        runs.append({"name": side.run.name, "run_id": side.run.run_id, "experiment": side.run.experiment,
                     "method": side.run.config.get("rl", MISSING), "eval": side.final.path,
                     "base_eval": side.base.path if side.base else None, "verifier": side.final.verifier,
                     "accuracy": accuracy(side.final), "base_accuracy": accuracy(side.base),
                     "reward_means": reward_means(side.final), "answers": answer_distribution(rows)})
    rounds = sorted(set(a.rounds) | set(b.rounds))
    return {
        "runs": runs, "prompts": len(ids),
        "config_differs": {row[0]: row[1:] for row in config_diff_rows([a.run, b.run])},
        "both_right": flips["both_right"], "both_wrong": flips["both_wrong"],
        "right_to_wrong": flips["right_to_wrong"][:limit], "wrong_to_right": flips["wrong_to_right"][:limit],
        "flips": {"right_to_wrong": len(flips["right_to_wrong"]), "wrong_to_right": len(flips["wrong_to_right"])},
        "rounds": [{"round": r, "runs": [a.rounds.get(r), b.rounds.get(r)]} for r in rounds],
    }


# ---------------------------------------------------------------- the terminal text (pure, from diff_data)

def one_line(text, width: int = COMPLETION_WIDTH) -> str:
    """A completion on one line (newlines as \\n), cut to `width` characters with '…'."""
    text = repr(str(text))[1:-1] if text is not None else MISSING
    return text if len(text) <= width else text[: width - 1] + "…"


def right_wrong(correct: bool | None) -> str:
    return MISSING if correct is None else "right" if correct else "wrong"


def flip_lines(data: dict, direction: str, shown: int) -> list[str]:
    """One direction's flips: a heading, then prompt, gold, base verdicts and both completions per row."""
    total, flips = data["flips"][direction], data[direction][:shown]
    title = "A right, B wrong" if direction == "right_to_wrong" else "A wrong, B right"
    out = [f"{direction.replace('_to_', ' -> ')}: {total} {'prompt' if total == 1 else 'prompts'} ({title})"]
    if flips:
        rows = [[f["prompt_id"], one_line(f["gold"], 12), "/".join(map(right_wrong, f["base_correct"])),
                 one_line(f["completions"][0]), one_line(f["completions"][1])] for f in flips]
        out.append(format_table(["prompt", "gold", "base A/B", "A said", "B said"], rows, indent="  "))
    if total > len(flips):
        out.append(f"  ({total - len(flips)} more: --limit N shows more, --json shows them in full)")
    return out


def eval_lines(data: dict) -> list[str]:
    """Accuracy (base in brackets), verifier, mean reward per verifier function and verdict counts, per run."""
    a, b = data["runs"]
    rows = [["accuracy", *[f"{fmt_number(r['accuracy'])} (base {fmt_number(r['base_accuracy'])})" for r in (a, b)]],
            ["verifier", *[", ".join(r["verifier"]) or MISSING for r in (a, b)]]]
    for fn in dict.fromkeys([*a["reward_means"], *b["reward_means"]]):
        rows.append([f"mean reward {fn}", *[fmt_number(r["reward_means"].get(fn)) for r in (a, b)]])
    flips = data["flips"]
    return [f"held-out eval: {data['prompts']} prompts, the same in both (final eval; base eval in brackets)",
            format_table(["", "A", "B"], rows, indent="  "),
            f"  verdicts: both right {data['both_right']}, both wrong {data['both_wrong']}, "
            f"right -> wrong {flips['right_to_wrong']}, wrong -> right {flips['wrong_to_right']}",
            *(["  note: the runs' verifiers differ, so a flip may be the verifier's verdict, not the policy's "
               "(compare the completions)"] if a["verifier"] != b["verifier"] else [])]


def answer_lines(data: dict) -> list[str]:
    """Each run's most common final answers with their counts, side by side."""
    tops = [r["answers"]["top"][:ANSWERS_SHOWN] for r in data["runs"]]
    rows = [[f"'{one_line(t[i][0], 24)}': {t[i][1]}" if i < len(t) else "" for t in tops]
            for i in range(max(map(len, tops)))]
    rows.append([f"({r['answers']['distinct']} distinct)" for r in data["runs"]])
    return ["answers (final eval, most common extracted answers: count)", format_table(["A", "B"], rows, indent="  ")]


def round_lines(data: dict) -> list[str]:
    """Per round, each run's reward mean ± std and completion length, then its mean reward per function; only the
    runs that have rounds get columns."""
    has = [i for i in (0, 1) if any(r["runs"][i] for r in data["rounds"])]
    if not has:
        return ["rounds: neither run has rounds of scored rollouts"]
    label = "AB"
    header = ["round", *[f"{label[i]} {c}" for i in has for c in ("reward mean ± std", "length")]]
    fns = [(i, fn) for i in has for fn in dict.fromkeys(f for r in data["rounds"] if r["runs"][i]
                                                        for f in r["runs"][i]["rewards"])]
    rows, per_fn = [], []
    for entry in data["rounds"]:
        stats = entry["runs"]
        rows.append([str(entry["round"]), *[c for i in has for c in (
            f"{fmt_number(stats[i]['reward_mean'])} ± {fmt_number(stats[i]['reward_std'])}" if stats[i] else MISSING,
            fmt_number(stats[i]["length_mean"]) if stats[i] else MISSING)]])
        per_fn.append([str(entry["round"]), *[fmt_number(stats[i]["rewards"].get(fn)) if stats[i] else MISSING
                                              for i, fn in fns]])
    out = ["rounds (scored rollouts: reward over the round's completions, length in tokens)",
           format_table(header, rows, indent="  ")]
    out += [f"  ({label[i]}: no rounds)" for i in (0, 1) if i not in has]
    if fns:
        out += ["reward per function (round mean)",
                format_table(["round", *[f"{label[i]} {fn}" for i, fn in fns]], per_fn, indent="  ")]
    return out


def config_lines(data: dict) -> list[str]:
    """The config keys both runs set to different values; the keys only one run has (another method's sections)
    counted by section."""
    config = data["config_differs"]
    both = [[key, *values] for key, values in config.items() if MISSING not in values]
    out = [f"config: {len(both)} {'key differs' if len(both) == 1 else 'keys differ'}"]
    for i, name in enumerate("AB"):
        alone = [key for key, values in config.items() if values[1 - i] == MISSING]
        if alone:
            sections = ", ".join(dict.fromkeys(key.split(".")[0] for key in alone))
            out[0] += f"; {len(alone)} set in {name} only ({sections})"
    if len(both) > CONFIG_SHOWN:
        out[0] += f"; the first {CONFIG_SHOWN} shown (posttrain compare A B lists them all)"
    if both:
        out.append(format_table(["key", "A", "B"], both[:CONFIG_SHOWN], indent="  "))
    return out


def diff_report(data: dict, shown: int = FLIPS_SHOWN) -> str:
    """The terminal text of `posttrain diff`: runs, differing config, eval, flips, answers, rounds."""
    out = [f"{'AB'[i]}  {r['name']}  (run {r['run_id']}, {r['experiment']}, rl {r['method']})"
           for i, r in enumerate(data["runs"])]
    out += [*config_lines(data), "", *eval_lines(data), ""]
    for direction in ("right_to_wrong", "wrong_to_right"):
        out += [*flip_lines(data, direction, shown), ""]
    out += [*answer_lines(data), "", *round_lines(data)]
    return "\n".join(out)


# ---------------------------------------------------------------- loading (MLflow + artifact folders)

def stage_folder(run: RunData, label: str, artifacts_dir: Path) -> Path | None:
    """The folder of the run's last stage called `label` with a manifest: summary.json's path, else
    <artifacts>/<stage>/<key> (a run known from its MLflow stage runs); None if it has none."""
    for stage in reversed(run.stages):
        if stage["stage"] == label and stage["key"] != MISSING:
            folder = Path(stage["path"]) if stage["path"] else ArtifactStore(artifacts_dir).path(
                label.split()[0], stage["key"])
            return folder if (folder / MANIFEST).exists() else None
    return None


def load_eval(run: RunData, label: str, artifacts_dir: Path) -> EvalTable | None:
    """The run's eval artifact `label` as an EvalTable (what each prompt asked: from the prompts file its manifest
    names, else the gold answer alone); None if the run has none."""
    folder = stage_folder(run, label, artifacts_dir)
    if folder is None:
        return None
    path = folder / "eval.parquet"
    columns = pq.read_schema(path).names if path.exists() else []
    if not {"prompt_id", "correct", "completion"} <= set(columns):
        raise CompareError(f"{run.name}'s {label} ({folder}) has no verdict per prompt (eval.parquet with prompt_id, "
                           "completion, correct), e.g. an ebft strided eval, which scores blocks of documents")
    rows = {r["prompt_id"]: r for r in pq.read_table(path).to_pylist()}
    manifest = json.loads((folder / MANIFEST).read_text())
    prompts = {}
    source = manifest.get("config", {}).get("prompts_path")  # [<stage>/<key>, <split>.parquet]
    prompts_file = folder.parent.parent.joinpath(*source) if isinstance(source, list) else None
    if prompts_file is not None and prompts_file.exists():
        prompts = {r["prompt_id"]: r.get("prompt") for r in pq.read_table(prompts_file).to_pylist()}
    asked = {pid: asked_digest(prompts.get(pid), row.get("answer")) for pid, row in rows.items()}
    return EvalTable(label, rows, list(manifest.get("summary", {}).get("verifier") or []), asked, str(folder))


def load_rounds(run: RunData, artifacts_dir: Path) -> dict[int, dict]:
    """round -> round_stats of its `score rN` stage's scored.parquet (the last record of each round)."""
    rounds = {}
    for stage in run.stages:
        match = ROUND_STAGE.fullmatch(stage["stage"])
        folder = stage_folder(run, stage["stage"], artifacts_dir) if match else None
        if folder is not None and (folder / "scored.parquet").exists():
            table = pq.read_table(folder / "scored.parquet")
            wanted = [c for c in ("reward", "rewards", "completion_token_ids") if c in table.column_names]
            rounds[int(match[1])] = round_stats(table.select(wanted).to_pylist())
    return rounds


def load_side(run: RunData, artifacts_dir: Path) -> Side:
    """A run's final eval (CompareError naming the run when it has none), base eval and rounds."""
    final = load_eval(run, FINAL, artifacts_dir)
    if final is None:
        reached = ", ".join(s["stage"] for s in run.stages) or "none recorded"
        why = ("it ran no held-out eval (its rows are a train split only, or rl: reward_model)"
               if run.status == "FINISHED" else f"it stopped ({run.status}) before it")
        raise CompareError(f"run {run.name} has no final eval artifact ({FINAL!r}) to diff: {why}; its stages: "
                           f"{reached}")
    return Side(run, final, load_eval(run, BASE, artifacts_dir), load_rounds(run, artifacts_dir))


def diff_command_data(refs: list[str], artifacts_dir: str, limit: int | None = None,
                      with_sides: Callable | None = None) -> dict:
    """diff_data of two runs named by run name or MLflow run id in the store of `artifacts_dir`; `with_sides(client,
    a, b)`, where given, is called with the two loaded runs first (`--html`: flows/report.py's page)."""
    client = open_client(artifacts_dir)
    a, b = (load_side(run, Path(artifacts_dir)) for run in resolve_runs(client, refs, Path(artifacts_dir)))
    if with_sides is not None:
        with_sides(client, a, b)
    return diff_data(a, b, limit)


# ---------------------------------------------------------------- command line

def diff_command(args, write_page: Callable | None = None) -> int:
    """`posttrain diff`: print the report (or --json); with --html also the page, by `write_page(client, a, b,
    artifacts_dir, path)` (the CLI passes flows/report.py's); exit 2 naming the problem on bad input."""
    from tasks.lineage import StoreBusyError

    html = getattr(args, "html", None)
    also = (lambda client, a, b: write_page(client, a, b, Path(args.artifacts), html)) if html else None
    try:
        data = diff_command_data(args.runs, args.artifacts, args.limit if args.json else None, also)
    except (CompareError, StoreBusyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = FLIPS_SHOWN if args.limit is None else args.limit
    print(json.dumps(data, indent=2, default=str) if args.json else diff_report(data, shown))
    if html:
        print(f"html: {html} (both runs as one page; opens offline in a browser)", file=sys.stderr)
    return 0
