"""What a run shows besides metrics: sample completions per round, a per-round metrics table and a
markdown summary, as MLflow tables/artifacts on the parent run and as Prefect artifacts.

Prefect artifact keys are per pipeline name (`<name>-completions`, `<name>-rounds`, `<name>-summary`),
so the Prefect UI keeps their history across runs of a config; MLflow gets one table per round
(`completions/round_<r>.json`, viewable in the run's Artifacts and Evaluation tabs). Rounds a run
found cached are published together when the next computed round (or the last round) comes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field


class TrackingConfig(BaseModel):
    """What each run publishes beyond metrics."""

    model_config = ConfigDict(extra="forbid")

    completions_per_round: int = Field(8, ge=0)
    """Sample completions per round logged as a table (prompt, completion, each reward, advantage,
    errors) to MLflow and Prefect; 0: none. Spread over the round's prompt groups."""


def artifact_key(name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for a pipeline name."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{name}-{what}".lower()).strip("-")


def _prompt_text(prompt) -> str:
    users = [m["content"] for m in prompt if m.get("role") == "user"] if isinstance(prompt, list) else []
    return users[-1] if users else str(prompt)


def sample_completions(scored_path, count: int) -> list[dict]:
    """`count` rows of a scored round, evenly spaced (so several prompt groups show), as flat dicts."""
    table = pq.read_table(scored_path, columns=["round_index", "prompt_id", "group_index", "prompt", "completion",
                                                "rewards", "reward", "advantage", "errors", "policy_version"])
    if count <= 0 or table.num_rows == 0:
        return []
    step = max(1, table.num_rows // count)
    rows = table.slice(0, step * count).to_pylist()[::step][:count]
    out = []
    for row in rows:
        flat = {"round": row["round_index"], "policy_version": row["policy_version"], "prompt_id": row["prompt_id"],
                "sample": row["group_index"], "prompt": _prompt_text(row["prompt"]), "completion": row["completion"],
                "reward": _rounded(row["reward"]), "advantage": _rounded(row["advantage"])}
        for name, value in dict(row["rewards"] or {}).items():
            flat[f"reward/{name}"] = _rounded(value)  # None: the function did not apply to this sample
        flat["errors"] = "; ".join(row["errors"] or [])
        out.append(flat)
    return out


def _rounded(value: float | None) -> float | None:
    """A value to 4 digits for the tables; None (a null or NaN) stays None: nothing to show, nothing to crash on."""
    return None if value is None or value != value else round(value, 4)


def publish_rounds(lineage, parent: str, name: str, rounds: list[tuple[int, list[dict]]]) -> None:
    """Rounds' sample completions: one MLflow table per round on the parent run
    (`completions/round_<r>.json`, as `MlflowClient.log_table` writes it) and one Prefect table
    artifact for them all. Several rounds (a cached rerun's) go in one upload and one Prefect call."""
    rounds = [(r, rows) for r, rows in rounds if rows]
    if not rounds:
        return
    import json
    import tempfile

    import pandas as pd
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS
    from prefect.artifacts import create_table_artifact

    with tempfile.TemporaryDirectory() as folder:
        for r, rows in rounds:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            pd.DataFrame({c: [row.get(c) for row in rows] for c in columns}).to_json(
                Path(folder) / f"round_{r:03d}.json", orient="split", index=False, date_format="iso")
        lineage.client.log_artifacts(parent, folder, artifact_path="completions")
    # the tag that lists a run's tables in the MLflow UI (what log_table keeps up to date)
    tables = json.loads(lineage.client.get_run(parent).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    new = [{"path": f"completions/round_{r:03d}.json", "type": "table"} for r, _ in rounds]
    tables += [t for t in new if t not in tables]
    lineage.client.set_tag(parent, MLFLOW_LOGGED_ARTIFACTS, json.dumps(tables))
    span = f"round {rounds[0][0]}" if len(rounds) == 1 else f"rounds {rounds[0][0]}-{rounds[-1][0]}"
    create_table_artifact(table=[row for _, rows in rounds for row in rows], key=artifact_key(name, "completions"),
                          description=f"{name}: sample completions of {span} with their rewards")


def publish_summary(name: str, results: dict, round_metrics: list[dict]) -> None:
    """The run's markdown summary and per-round metrics table as Prefect artifacts."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from tasks.reporting import headline

    model = results.get("reward_model") or results.get("exported_model")
    lines = [f"# {results['run_name']}", "", *[f"{line}  " for line in headline(results)], "",
             f"- MLflow run: `{results['mlflow_run_id']}` (`{results['mlflow_ui']}`)",
             f"- {'reward' if results.get('rl') == 'reward_model' else 'exported'} model: `{model}` (registered "
             f"version {results['registered_model_version']})"]
    if results.get("report"):  # flows/report.py: one self-contained page, also the MLflow artifact report.html
        lines.append(f"- report: [{Path(results['report']).name}]({Path(results['report']).as_uri()}) "
                     f"(`{results['report']}`; the MLflow run's artifact report.html)")
    if results.get("promotion"):
        promotion = results["promotion"]
        lines.append(f"- promotion: {promotion.get('reason', promotion) if isinstance(promotion, dict) else promotion}")
    if results.get("health"):  # stages/evaluation/health.py findings: metrics outside their healthy ranges
        lines += ["", f"## Health warnings ({len(results['health'])})", ""]
        lines += [f"- round {f['round']}: `{f['metric']}` = {f['value']:.4g} (healthy: {f['range']}): {f['message']}"
                  for f in results["health"]]
    lines += ["", "| stage | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds']:.1f} |" for s in results["stages"]]
    create_markdown_artifact(markdown="\n".join(lines), key=artifact_key(name, "summary"),
                             description=f"{name}: run summary")
    if round_metrics:
        create_table_artifact(table=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                                     for row in round_metrics],
                              key=artifact_key(name, "rounds"), description=f"{name}: metrics per round")
