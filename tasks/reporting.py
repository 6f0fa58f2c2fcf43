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
        self.console = Console(stderr=False, highlight=False)
        self.quiet = quiet
        self._lock = threading.Lock()

    def _print(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                self.console.print(text)

    def start(self, label: str) -> float:
        self._print(f"[bold cyan]>[/] {label} ...")
        return time.time()

    def done(self, label: str, stage: str, path: Path, cached: bool, started: float | None = None,
             note: str = "") -> None:
        seconds = 0.0 if cached else time.time() - (started or time.time())
        self.rows.append({"stage": label, "kind": stage, "status": "cached" if cached else "computed",
                          "seconds": seconds, "path": str(path)})
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
        self.console.print(
            f"eval/accuracy  base: {results['base_accuracy']:.3f}   final: {results['final_accuracy']:.3f}   "
            f"gain: {results['final_accuracy'] - results['base_accuracy']:+.3f}  "
            f"({results['eval_prompts']} held-out prompts)"
        )
        self.console.print(f"MLflow run: {results['mlflow_run_id']}  (experiment {results['experiment']!r})")
        self.console.print(f"exported model: {results['exported_model']}")
        self.console.print(f"open the MLflow UI: {results['mlflow_ui']}")
