"""A run you can watch (issue 44 item 5): one console line per round with its reward, KL, entropy, completion
length and seconds, and the run's ETA from the rounds computed so far (flows/rounds.py RoundLog.show_round).
The whole run's lines, the CLI without Prefect's chatter: tests/test_preflight.py."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from flows.config import load_config
from flows.rounds import RoundLog, format_eta
from tasks.reporting import Reporter

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def test_format_eta():
    assert [format_eta(s) for s in (0.4, 12, 185, 3725)] == ["0s", "12s", "3m05s", "1h02m"]


def test_a_line_per_round_with_an_eta_from_the_computed_rounds(tmp_path, monkeypatch):
    reporter = Reporter(tmp_path)
    reporter.console = Console(file=io.StringIO(), width=200)
    ctx = SimpleNamespace(config=load_config(QUICKSTART, ["grpo.rounds=4"]), reporter=reporter)
    log = RoundLog.__new__(RoundLog)  # only what show_round reads: the config's rounds and the reporter
    log.ctx, log.computed_s = ctx, []
    clock = iter([0.0, 10.0, 40.0])  # round 1 cached at 0 s, round 2 computed in 10 s, round 3 in 30 s
    monkeypatch.setattr("flows.rounds.time.perf_counter", lambda: next(clock))
    log.last_finished = 0.0
    metrics = {"train/reward_mean": 0.5, "train/kl": 0.0012, "train/entropy": 0.35, "train/completion_length": 7.9}
    log.show_round(metrics, 0, cached=True)
    log.show_round(metrics, 1, cached=False)
    log.show_round({"train/reward_mean": 0.75}, 2, cached=False)
    lines = reporter.console.file.getvalue().splitlines()
    assert lines[0] == "round 1/4:  reward 0.500  kl 0.0012  entropy 0.350  length 7.9  cached"
    assert lines[1] == "round 2/4:  reward 0.500  kl 0.0012  entropy 0.350  length 7.9  10.0s  ETA 20s"
    assert lines[2] == "round 3/4:  reward 0.750  30.0s  ETA 20s"  # (10 + 30) / 2 s a round, one left
