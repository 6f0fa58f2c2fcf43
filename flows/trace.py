"""One prompt of a run traced to its sources (`posttrain trace`).

For a held-out eval row (by prompt id or row index) or a train prompt of a run: its prompt, and for an eval row the
final eval's completion and verdict; the chain of artifacts the final eval's model was computed from, read from each
manifest's `inputs` (eval final <- export <- optimize rN <- ... <- sft <- base_model <- transform <- source), every
manifest's inputs followed, nothing guessed; per round the scored rollouts of that prompt (policy version, engine,
finish reason, rewards per function, advantage), or, when the round did not train on it (a held-out prompt never is),
the round's summary (prompts trained, policy versions, engines); the reward functions the score stage ran with the
source digests its key holds of user code (score manifest config `user_code`; built-ins are versioned with posttrain)
and the MLflow run's `code.<module>` tags; the data source and row the prompt came from (the transform manifest's
`raw_files` entry for the prompt's split, and the row index the prompt id carries: `<split>-<row>`).

Runs are found as `posttrain compare` finds them (flows/compare.py `resolve_runs`); stage folders as `posttrain diff`
finds them (flows/diff.py `stage_folder`). Reads only; recomputes nothing.

  posttrain trace RUN [PROMPT_ID | --eval-row N] [--artifacts DIR] [--json]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq

from flows.compare import MISSING, CompareError, fmt_number, format_table, open_client, resolve_runs
from flows.diff import FINAL, ROUND_STAGE, one_line, right_wrong, stage_folder
from tasks.store import MANIFEST

LISTED = 10  # eval rows listed when no prompt is named
CHAIN_INPUTS = ("adapter", "policy", "model", "prompts", "raw")  # which input the chain follows, first present wins
ROLLOUT_COLUMNS = ("rollout_id", "group_index", "completion", "policy_version", "engine", "finish_reason", "rewards",
                   "reward", "advantage", "errors")
PROMPTS_SHOWN = 8  # trained prompt ids shown per round summary in the terminal


def read_manifest(artifacts_dir: Path, ref: str) -> dict:
    """The manifest of artifact `<stage>/<key>`; CompareError naming it when the store lacks it."""
    path = artifacts_dir / ref / MANIFEST
    if not path.exists():
        raise CompareError(f"artifact {ref} is named as an input but has no manifest at {path}: the store is "
                           "incomplete (deleted or pruned)")
    return json.loads(path.read_text())


def lineage(artifacts_dir: Path, start: str) -> tuple[list[str], dict[str, dict]]:
    """(chain, graph) from artifact `start`: graph is every artifact reachable through manifests' `inputs`
    ({ref: {stage, inputs}}), chain the path that follows the first of CHAIN_INPUTS each manifest names (the model
    line: export <- optimize rounds <- sft <- base_model <- transform <- source)."""
    graph, todo = {}, [start]
    while todo:
        ref = todo.pop(0)
        if ref in graph:
            continue
        manifest = read_manifest(artifacts_dir, ref)
        inputs = {name: value for name, value in (manifest.get("inputs") or {}).items() if value}
        graph[ref] = {"stage": manifest.get("stage"), "inputs": inputs, "summary_keys": sorted(manifest.get("summary")
                                                                                                or {})}
        todo += [v for v in inputs.values() if v not in graph]
    chain, ref = [start], start
    while True:
        inputs = graph[ref]["inputs"]
        nxt = next((inputs[n] for n in CHAIN_INPUTS if n in inputs), next(iter(inputs.values()), None))
        if nxt is None or nxt in chain:
            return chain, graph
        chain.append(nxt)
        ref = nxt


def ref_of(folder: Path) -> str:
    return f"{folder.parent.name}/{folder.name}"


def split_rows(artifacts_dir: Path, transform: str) -> dict[str, dict]:
    """prompt_id -> {split, row, prompt, answer} over the transform's split files."""
    manifest = read_manifest(artifacts_dir, transform)
    out = {}
    for name in manifest.get("files") or {}:
        if name.endswith(".parquet"):
            table = pq.read_table(artifacts_dir / transform / name)
            wanted = [c for c in ("prompt_id", "prompt", "answer") if c in table.column_names]
            if "prompt_id" not in wanted:
                continue
            for i, row in enumerate(table.select(wanted).to_pylist()):
                out.setdefault(row["prompt_id"], {"split": name.removesuffix(".parquet"), "split_row": i,
                                                  "prompt": row.get("prompt"), "answer": row.get("answer")})
    return out


def source_of(artifacts_dir: Path, transform: str, split: str, prompt_id: str) -> dict:
    """Where the transform read the prompt's split from (manifest config `raw_files`, else its `inputs`) and the raw
    row index its id carries (`<split>-<row>`, `<split>-<source>-<row>`)."""
    manifest = read_manifest(artifacts_dir, transform)
    raw = (manifest.get("config") or {}).get("raw_files") or {}
    entry = raw.get(split)
    match = re.fullmatch(r"(.+?)-(?:(.+)-)?(\d+)", prompt_id)
    return {"transform": transform, "split": split, "file": "/".join(entry) if isinstance(entry, list) else entry,
            "inputs": manifest.get("inputs") or {}, "source": match[2] if match else None,
            "row": int(match[3]) if match else None}


def reward_code(artifacts_dir: Path, score_ref: str) -> dict:
    """The score stage's reward functions, weights, and the user code digests its key holds."""
    cfg = (read_manifest(artifacts_dir, score_ref).get("config") or {}).get("cfg") or {}
    fields = cfg.get("fields") or {}
    digests = {name: digest for name, digest in cfg.get("user_code") or []}
    funcs = fields.get("reward_funcs") or []
    return {"score": score_ref, "reward_funcs": funcs, "reward_weights": fields.get("reward_weights"),
            "digests": {fn: digests.get(fn, "built-in (versioned with posttrain)") for fn in funcs}}


def round_entry(artifacts_dir: Path, index: int, folder: Path, prompt_id: str, prompt) -> dict:
    """One round: its score/rollout keys, the scored rows of the prompt (by id, or by identical prompt messages), or
    the round's summary when it did not train on the prompt."""
    table = pq.read_table(folder / "scored.parquet")
    manifest = read_manifest(artifacts_dir, ref_of(folder))
    ids = table.column("prompt_id").to_pylist()
    prompts = table.column("prompt").to_pylist() if prompt is not None and "prompt" in table.column_names else None
    hits = [i for i, pid in enumerate(ids) if pid == prompt_id or (prompts is not None and prompts[i] == prompt)]
    cols = [c for c in ROLLOUT_COLUMNS if c in table.column_names]
    rows = table.select(cols).take(hits).to_pylist() if hits else []
    for row in rows:
        row["completion_tokens"] = None
        if isinstance(row.get("rewards"), list):
            row["rewards"] = dict(row["rewards"])
    if hits and "completion_token_ids" in table.column_names:
        for row, ids_ in zip(rows, table.column("completion_token_ids").take(hits).to_pylist()):
            row["completion_tokens"] = len(ids_ or ())
    summary = {"prompts": sorted(set(ids)), "samples": len(ids),
               "policy_versions": sorted(set(table.column("policy_version").to_pylist())),
               "engines": sorted(set(table.column("engine").to_pylist()))}
    return {"round": index, "score": ref_of(folder), "rollouts": (manifest.get("inputs") or {}).get("rollouts"),
            "trained_on_prompt": bool(hits), "rollout_rows": rows, "summary": summary}


def eval_rows(artifacts_dir: Path, run) -> tuple[Path, list[dict]]:
    folder = stage_folder(run, FINAL, artifacts_dir)
    if folder is None:
        raise CompareError(f"run {run.name} has no final eval artifact ({FINAL!r}) to trace from; its stages: "
                           f"{', '.join(s['stage'] for s in run.stages) or 'none recorded'}")
    return folder, pq.read_table(folder / "eval.parquet").to_pylist()


def trace_data(artifacts_dir: str | Path, ref: str, prompt_id: str | None = None, eval_row: int | None = None,
               listed: int = LISTED) -> dict:
    """Everything `posttrain trace` shows, one JSON-ready dict. No prompt_id/eval_row: the first `listed` eval rows."""
    artifacts_dir = Path(artifacts_dir)
    run = resolve_runs(open_client(artifacts_dir), [ref], artifacts_dir)[0]
    head = {"run": run.name, "run_id": run.run_id, "experiment": run.experiment, "status": run.status}
    folder, rows = eval_rows(artifacts_dir, run)
    if prompt_id is None and eval_row is None:
        return {**head, "eval": ref_of(folder), "eval_rows": len(rows), "listed": [
            {"row": i, "prompt_id": r["prompt_id"], "correct": bool(r["correct"]), "answer": r.get("answer"),
             "predicted_answer": r.get("predicted_answer")} for i, r in enumerate(rows[:listed])]}
    if eval_row is not None:
        if not 0 <= eval_row < len(rows):
            raise CompareError(f"--eval-row {eval_row} is not in run {run.name}'s final eval ({ref_of(folder)}): it "
                               f"has rows 0 to {len(rows) - 1}")
        prompt_id = rows[eval_row]["prompt_id"]
    chain, graph = lineage(artifacts_dir, ref_of(folder))
    transform = next((r for r in chain if graph[r]["stage"] == "transform"), None)
    known = split_rows(artifacts_dir, transform) if transform else {}
    row_index = next((i for i, r in enumerate(rows) if r["prompt_id"] == prompt_id), None)
    if prompt_id not in known and row_index is None:
        raise CompareError(f"prompt id {prompt_id!r} is not in run {run.name}: not a row of its transform "
                           f"({transform}: {', '.join(sorted({v['split'] for v in known.values()}))} splits) or of its "
                           f"final eval; `posttrain trace {run.name}` lists eval rows")
    asked = known.get(prompt_id, {})
    rounds, code = [], []
    for stage in run.stages:
        match = ROUND_STAGE.fullmatch(stage["stage"])
        score = stage_folder(run, stage["stage"], artifacts_dir) if match else None
        if score is not None and (score / "scored.parquet").exists():
            rounds.append(round_entry(artifacts_dir, int(match[1]), score, prompt_id, asked.get("prompt")))
            code.append(reward_code(artifacts_dir, ref_of(score)))
    for r in chain:  # the rounds whose rollouts trained the evaluated model
        for name, value in graph[r]["inputs"].items():
            if name == "scored":
                for entry in rounds:
                    entry["in_chain"] = entry.get("in_chain") or entry["score"] == value
    return {**head, "prompt_id": prompt_id, "split": asked.get("split"), "prompt": asked.get("prompt"),
            "answer": asked.get("answer"),
            "eval": {"artifact": ref_of(folder), "row": row_index, **({k: rows[row_index].get(k) for k in (
                "completion", "predicted_answer", "reward", "correct", "errors")} if row_index is not None else {})},
            "chain": [{"artifact": r, "stage": graph[r]["stage"], "inputs": graph[r]["inputs"]} for r in chain],
            "graph": graph, "rounds": rounds,
            "reward_code": code[-1] if code else None, "reward_code_per_round": code,
            "reward_code_changed": len({json.dumps(c["digests"], sort_keys=True) for c in code}) > 1,
            "mlflow_code_tags": run.code,
            "source": source_of(artifacts_dir, transform, asked["split"], prompt_id) if asked else None}


# ---------------------------------------------------------------- the terminal text (pure, from trace_data)

def listing_report(data: dict) -> str:
    rows = [[str(r["row"]), r["prompt_id"], right_wrong(r["correct"]), one_line(r["answer"], 12),
             one_line(r["predicted_answer"], 24)] for r in data["listed"]]
    return "\n".join([f"run {data['run']} ({data['run_id']}): final eval {data['eval']}, {data['eval_rows']} rows; "
                      f"the first {len(rows)}:", format_table(["row", "prompt_id", "verdict", "gold", "answered"],
                                                              rows, indent="  "),
                      f"posttrain trace {data['run']} PROMPT_ID (or --eval-row N) traces one"])


def prompt_text(prompt) -> str:
    if isinstance(prompt, list):
        return " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return MISSING if prompt is None else str(prompt)


def round_lines(entry: dict) -> list[str]:
    head = (f"round {entry['round']}  score {entry['score']} <- {entry['rollouts']}"
            + ("" if entry.get("in_chain", True) else "  (not in the final model's chain)"))
    s = entry["summary"]
    if not entry["trained_on_prompt"]:
        shown = ", ".join(s["prompts"][:PROMPTS_SHOWN]) + (f", … ({len(s['prompts'])})" if len(s["prompts"]) >
                                                             PROMPTS_SHOWN else "")
        return [head, f"  not trained on this prompt; the round trained {len(s['prompts'])} prompts "
                      f"({s['samples']} rollouts): {shown}",
                f"  policy version {', '.join(map(str, s['policy_versions']))}, engine {', '.join(s['engines'])}"]
    rows = [[str(r.get("group_index")), str(r.get("policy_version")), str(r.get("engine")), str(r.get("finish_reason")),
             " ".join(f"{fn}={fmt_number(v)}" for fn, v in (r.get("rewards") or {}).items()),
             fmt_number(r.get("reward")), fmt_number(r.get("advantage")), one_line(r.get("completion"), 32)]
            for r in entry["rollout_rows"]]
    return [head, format_table(["g", "policy", "engine", "finish", "rewards", "reward", "advantage", "completion"],
                               rows, indent="  ")]


def trace_report(data: dict) -> str:
    """The terminal text of `posttrain trace` for one prompt."""
    ev = data["eval"]
    out = [f"run {data['run']} ({data['run_id']}, {data['status']})",
           f"prompt {data['prompt_id']} ({data['split'] or 'eval'} split)  gold {data['answer']}",
           f"  {one_line(prompt_text(data['prompt']), 160)}"]
    if ev["row"] is not None:
        out += [f"final eval {ev['artifact']} row {ev['row']}: {right_wrong(bool(ev['correct']))} "
                f"(reward {fmt_number(ev['reward'])}, answered {one_line(ev['predicted_answer'], 24)})",
                f"  completion: {one_line(ev['completion'], 160)}"]
    else:
        out.append(f"final eval {ev['artifact']}: no row for this prompt (a train prompt)")
    src = data["source"]
    if src:
        out.append(f"source: row {src['row'] if src['row'] is not None else MISSING} of {src['file'] or MISSING}"
                   f"{' (source ' + src['source'] + ')' if src['source'] else ''}, via {src['transform']}")
    out += ["", "model chain (each from its manifest's inputs):",
            *[f"  {'<- ' if i else '   '}{c['artifact']}" for i, c in enumerate(data["chain"])]]
    code = data["reward_code"]
    if code:
        out += ["", f"reward functions ({code['score']}): " + ", ".join(
            f"{fn} [{digest}]" for fn, digest in code["digests"].items())]
        if data["reward_code_changed"]:
            out.append("  note: the rounds' reward code differs (--json lists each round's)")
    if data["mlflow_code_tags"]:
        out.append("  MLflow code tags: " + ", ".join(f"{m}={d}" for m, d in data["mlflow_code_tags"].items()))
    out += ["", "rounds:"] if data["rounds"] else ["", "rounds: none (no scored rollouts in this run)"]
    for entry in data["rounds"]:
        out += round_lines(entry)
    return "\n".join(out)


# ---------------------------------------------------------------- command line

def trace_command(args) -> int:
    """`posttrain trace`: print the trace (or --json); exit 2 naming the problem on bad input."""
    from tasks.lineage import StoreBusyError

    try:
        data = trace_data(args.artifacts, args.run, args.prompt_id, args.eval_row)
    except (CompareError, StoreBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(listing_report(data) if "listed" in data else trace_report(data))
    return 0
