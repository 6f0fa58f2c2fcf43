"""What the user sees while the pipeline runs: a line per stage start/finish, progress
bars for rollouts, optimizer steps and eval, and the end-of-run summary table."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm


class Reporter:
    """Collects a row per stage and prints progress to the terminal."""

    def __init__(self, artifacts_root: Path, quiet: bool = False):
        self.root = artifacts_root
        self.rows: list[dict] = []
        self.warnings: list[str] = []
        self.console = Console(stderr=False, highlight=False)
        self.quiet = quiet
        self._lock = threading.Lock()

    def _print(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                self.console.print(text)

    def line(self, text: str) -> None:
        """A plain line (no markup) unless quiet: the run's start, each round, each periodic eval."""
        if not self.quiet:
            with self._lock:
                self.console.print(text, soft_wrap=True, markup=False)

    def start(self, label: str) -> float:
        self._print(f"[bold cyan]>[/] {label} ...")
        return time.time()

    def warn(self, text: str) -> None:
        """A warning line; printed even with quiet, on stderr, and kept in `warnings` for the run summary."""
        self.warnings.append(text)
        with self._lock:
            print(f"warning: {text}", file=sys.stderr)

    def done(self, label: str, stage: str, path: Path, cached: bool, started: float | None = None,
             note: str = "", cost: dict | None = None) -> None:
        """A finished stage's row; `cost`: its manifest's cost record (tasks/costs.py), the row's `cost` when it
        was computed here, its `avoided` when it was read from the cache (it cost nothing in this run)."""
        seconds = 0.0 if cached else time.time() - (started or time.time())
        self.rows.append({"stage": label, "kind": stage, "status": "cached" if cached else "computed",
                          "seconds": seconds, "path": str(path),
                          **({"avoided" if cached else "cost": cost} if cost is not None else {})})
        status = "[green]cached[/]" if cached else f"computed in {seconds:.1f}s"
        self._print(f"[bold green]✓[/] {label}: {status}{'  ' + note if note else ''}")

    def progress(self, label: str, unit: str):
        """A callback(done, total) drawing a tqdm bar on stderr."""
        bar = None

        def update(done: int, total: int) -> None:
            nonlocal bar
            if self.quiet:
                return
            if bar is None:
                bar = tqdm(total=total, desc=f"  {label}", unit=unit, leave=False, file=sys.stderr)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()

        return update

    def summary(self, results: dict) -> None:
        table = Table(title="posttrain run summary")
        for column in ("stage", "status", "wall time", "artifact"):
            table.add_column(column)
        for row in self.rows:
            try:
                shown = str(Path(row["path"]).relative_to(Path.cwd()))
            except ValueError:
                shown = row["path"]
            table.add_row(row["stage"], row["status"], f"{row['seconds']:.1f}s", shown)
        self.console.print(table)
        computed = sum(r["status"] == "computed" for r in self.rows)
        self.console.print(f"stages computed: {computed} of {len(self.rows)}")
        if results.get("cost"):
            self.console.print(cost_line(results["cost"]), soft_wrap=True, markup=False)
        for line in headline(results):
            warning = line.startswith("WARNING")
            self.console.print(line, soft_wrap=True, markup=False, style="yellow" if warning else None)
        self.console.print(f"MLflow run: {results['mlflow_run_id']}  (experiment {results['experiment']!r})")
        if results.get("rl") == "reward_model":
            self.console.print(f"reward model: {results['reward_model']}", soft_wrap=True, markup=False)
            self.console.print(f"use it in a GRPO run: {results['score_with']}", soft_wrap=True, markup=False)
        else:
            self.console.print(f"exported model: {results['exported_model']}", soft_wrap=True, markup=False)
        # soft_wrap: paths and commands stay one line to copy, whatever the terminal's (or a pipe's 80) width
        self.console.print(f"open the MLflow UI: {results['mlflow_ui']}", soft_wrap=True, markup=False)
        if results.get("report"):
            self.console.print(f"run report (one HTML page): {results['report']}", soft_wrap=True, markup=False)


def cost_line(cost: dict) -> str:
    """The run's cost in a line (tasks/costs.py `run_totals`)."""
    spent, avoided = cost["spent"], cost["avoided"]

    def seconds(record: dict) -> str:
        return ", ".join(f"{name.removesuffix('_s')} {record[name]:.1f}s" for name in ("wall_s", "cpu_s", "gpu_s")
                         if record.get(name) is not None) or "nothing"

    tokens = ", ".join(f"{spent[name] or 0} {name.removeprefix('tokens_')}"
                       for name in ("tokens_generated", "tokens_trained", "tokens_scored"))
    line = f"cost: {seconds(spent)}; tokens {tokens}; avoided by the cache: {seconds(avoided)}"
    per = cost.get("per_1k_tokens_trained", {}).get("cpu_s")
    if per is not None:
        line += f"; CPU {per:.3f}s per 1k tokens trained"
    per = cost.get("per_accepted_sample", {}).get("cpu_s")
    if per is not None:
        line += f", {per:.3f}s per accepted sample ({cost['accepted_samples']})"
    return line


def headline(results: dict) -> list[str]:
    """The run's result in a line or two: the policy's held-out accuracy base -> final (with the constant
    baseline notes), or a reward model's accuracy on the preferences' eval split before -> after training."""
    if results.get("rl") == "reward_model":
        before, after = results.get("accuracy_before"), results.get("accuracy_after")
        if after is None:
            return [f"reward model ({results['reward_model_kind']}): no eval split, no accuracy measured"]
        return [f"reward_model/{results['accuracy_metric']}  before: {before:.3f}   after: {after:.3f}   "
                f"({results['eval_rows']} held-out {'rows' if results['reward_model_kind'] == 'prm' else 'pairs'})"]
    if results.get("held_out_eval") is False:
        return no_eval_headline(results)
    return [f"eval/accuracy  base: {results['base_accuracy']:.3f}   final: {results['final_accuracy']:.3f}   "
            f"gain: {results['final_accuracy'] - results['base_accuracy']:+.3f}  "
            f"({results['eval_prompts']} held-out prompts)", *accuracy_notes(results)]


def no_eval_headline(results: dict) -> list[str]:
    """A run without a prompt eval: why, and what it measured instead (training reward of the first and last
    rounds, or the DPO family's held-out preference accuracy)."""
    lines = [f"eval: no held-out prompts ({results.get('no_eval_reason')})"]
    first, last = results.get("train_reward_first"), results.get("train_reward_last")
    if first is not None:
        lines.append(f"train/reward_mean  first round: {first:.3f}   last round: {last:.3f}   "
                     f"({results.get('train_rounds')} rounds, on training prompts, not held out)")
    before, after = results.get("preference_accuracy_base"), results.get("preference_accuracy_final")
    if after is not None:
        lines.append(f"eval/preference_accuracy  base: {before:.3f}   final: {after:.3f}   (held-out pairs)")
    kto = results.get("kto_heldout")
    if kto:
        margin = "n/a (one label only)" if kto["rewards_margins"] is None else f"{kto['rewards_margins']:+.3f}"
        lines.append(f"eval/kto  reward margin: {margin}   label accuracy: {kto['label_accuracy']:.3f}   "
                     f"({kto['rows']} held-out rows, {kto['desirable']} desirable; rewards are beta x log-prob "
                     "change from the starting policy, 0 there)")
    return lines


BASELINE_MARGIN = 0.05
"""Final accuracy below constant baseline + this is no evidence of learning the task."""


def accuracy_notes(results: dict) -> list[str]:
    """The constant baseline beside the accuracies, and plain warnings when the final policy answers
    (nearly) the same thing to every prompt or does not beat always giving the most common answer."""
    baseline = results.get("constant_baseline")
    if baseline is None:  # a summary written before the eval recorded it
        return []
    final = results["final_accuracy"]
    lines = [f"constant baseline: {baseline:.3f} (always answering {results.get('baseline_answer')!r})   "
             f"gain over it: {final - baseline:+.3f}   final answers: {results.get('final_distinct_answers')} "
             f"distinct, entropy {results.get('final_answer_entropy') or 0.0:.2f} nats"]
    if results.get("final_constant_policy"):
        lines.append(f"WARNING: the final policy gives the answer {results['final_top_answer']!r} to "
                     f"{results['final_top_answer_frac']:.0%} of held-out prompts (a constant answer); its accuracy "
                     f"{final:.3f} is what a constant answer scores (constant baseline {baseline:.3f}), not learning.")
    elif final < baseline + BASELINE_MARGIN:
        lines.append(f"WARNING: final accuracy {final:.3f} is below the constant baseline {baseline:.3f} + "
                     f"{BASELINE_MARGIN}: always answering {results.get('baseline_answer')!r} scores about as well; "
                     "no evidence the policy learned the task.")
    return lines
