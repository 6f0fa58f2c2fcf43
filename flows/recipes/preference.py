"""The DPO family (rl: dpo | ipo | kto | orpo | simpo): one preference-optimization stage on the preferences
table (your `preferences`, or demo pairs), TRL's trainers (stages/training/dpo.py lists which and where we depart).
"""

from __future__ import annotations

import time

from flows.rounds import Trained
from flows.run import log_preferences
from tasks.stage_tasks import RunContext, preference_optimization_task, preferences_task


def train(ctx: RunContext, parent: str, policy, prompts) -> Trained:
    """preferences -> dpo/ipo/kto/orpo/simpo from `policy`, its metrics and held-out preference accuracy logged
    to the parent run."""
    started = time.perf_counter()
    prefs = log_preferences(ctx, parent, preferences_task(ctx))
    trained = preference_optimization_task(ctx, policy, prefs, label=ctx.config.rl)
    summary = trained.manifest["summary"]
    metrics = {f"train/{k}": v for k, v in (summary.get("final_metrics") or {}).items() if isinstance(v, (int, float))}
    ctx.lineage.log_metrics(parent, metrics, step=1)
    if summary.get("eval_accuracy_before") is not None:  # held-out pairs with chosen log-prob margin > 0
        ctx.lineage.log_metrics(parent, {"eval/preference_accuracy": summary["eval_accuracy_before"]}, step=0)
        ctx.lineage.log_metrics(parent, {"eval/preference_accuracy": summary["eval_accuracy_after"]}, step=1)
        metrics["eval/preference_accuracy"] = summary["eval_accuracy_after"]
    kto = summary.get("eval_kto")
    if kto:  # TRL's KTOTrainer's eval metrics: implicit rewards of the held-out rows (0 for the starting policy)
        heldout = {f"eval/kto_{k}": kto[k] for k in ("rewards_chosen", "rewards_rejected", "rewards_margins",
                                                       "label_accuracy") if kto[k] is not None}
        ctx.lineage.log_metrics(parent, heldout, step=1)
        metrics.update(heldout)
    return Trained(trained, metrics, time.perf_counter() - started,
                   lineage={"preferences": prefs.key, ctx.config.rl: trained.key},
                   results={"preference_accuracy_base": summary.get("eval_accuracy_before"),
                            "preference_accuracy_final": summary.get("eval_accuracy_after"), "kto_heldout": kto})
