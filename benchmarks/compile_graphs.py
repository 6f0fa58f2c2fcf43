"""How often `train.compile` compiles over a run's rounds: dynamo graphs after each optimize round.

  PYTHONPATH=. .venv/bin/python benchmarks/compile_graphs.py [--layers 4] [--adapter lora]
                                                             [--out compile-graphs.json]

Each transformer block of the trained model is `torch.compile`d (stages/runtime/devices.py `compiled`). A
graph is compiled for the shapes a block first meets, again for dynamic shapes once one of them changes,
and once per variant (with and without gradients; with a KV cache, per block and per pass); past dynamo's
recompile limit a block runs eagerly. This runs five GRPO rounds (`stages.training.grpo.run`, bf16 autocast
on the CPU, beta 0.04 and two iterations, so the no-gradient reference and pi_old passes run too) on a
random-init Qwen2 of `--layers` blocks, each round with its own number of prompts, prompt and completion
lengths and micro-batches of 6 rows (groups of 8 split across them), and reports after each round: the
graphs compiled so far, the round's seconds, and whether dynamo hit its recompile limit. Twice: as the
stage runs with train.compile (`plain`: one forward per micro-batch, no KV cache), and with the shared
prompt pass forced on (`shared`: what train.compile ran before it turned the pass off; the two passes
share a KV cache). Graph counts are the point; CPU seconds mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

ROUNDS = [(3, 16, 24), (5, 19, 29), (4, 22, 34), (6, 13, 20), (5, 25, 31)]  # (prompts, prompt, completion tokens)


class LimitSeen(logging.Handler):
    """Notes dynamo's "hit config.recompile_limit" warning."""

    def __init__(self):
        super().__init__()
        self.hit = False

    def emit(self, record):
        self.hit = self.hit or "recompile_limit" in record.getMessage()


def rounds(model_dir: Path, work: Path, adapter: str, shared: bool) -> list[dict]:
    import torch
    from torch._dynamo.utils import counters

    import gpu_common
    from stages.runtime.devices import DeviceConfig
    from stages.training import grpo

    torch._dynamo.reset()
    original_init = grpo.RoundTrainer.__init__

    def forced(self, *args, **kwargs):  # the shared prompt pass, which train.compile turns off
        original_init(self, *args, **kwargs)
        self.plain_forward = False

    if shared:
        grpo.RoundTrainer.__init__ = forced
    seen = LimitSeen()
    logging.getLogger("torch._dynamo").addHandler(seen)
    devices = DeviceConfig(device="cpu", precision="bf16", compile=True)
    start = counters["stats"]["unique_graphs"]
    out = []
    name = "shared" if shared else "plain"
    for index, (prompts, prompt_tokens, completion_tokens) in enumerate(ROUNDS):
        scored = work / f"{name}-{index}.parquet"
        gpu_common.synthetic_scored(scored, prompts, 8, prompt_tokens, completion_tokens, 300, 300, seed=index)
        cfg = grpo.GRPOConfig(adapter=adapter, beta=0.04, loss_type="dapo", micro_batch_size=6,
                              gradient_accumulation_steps=4, num_iterations=2, reuse_sampling_logps=False,
                              shared_prompt_pass=shared, learning_rate=2e-4)
        started = time.perf_counter()
        grpo.run(cfg, model_dir, None, scored, 0, 1.0, 64, work / f"{name}-{index}", devices=devices)
        out.append({"round": index, "rows": prompts * 8, "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens, "seconds": round(time.perf_counter() - started, 1),
                    "graphs_so_far": counters["stats"]["unique_graphs"] - start, "recompile_limit_hit": seen.hit})
        print(json.dumps({"shared_prompt_pass": shared, **out[-1]}), flush=True)
    logging.getLogger("torch._dynamo").removeHandler(seen)
    grpo.RoundTrainer.__init__ = original_init
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--adapter", choices=["lora", "none"], default="lora")
    parser.add_argument("--recompile-limit-per-block", type=int, default=None,
                        help="raise dynamo's recompile limit to N x layers first (devices.compiled sets 8 x)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    import gpu_common

    hf_logging.disable_progress_bar()
    if args.recompile_limit_per_block:  # devices.compiled keeps a higher limit than its own
        torch._dynamo.config.recompile_limit = args.recompile_limit_per_block * args.layers
    work = Path(tempfile.mkdtemp(prefix="posttrain-compile-"))
    tiny = gpu_common.SIZES["tiny"]
    sizes = {**tiny, "model": {**tiny["model"], "num_hidden_layers": args.layers}}
    gpu_common.build_model(work / "model", sizes, "cpu")
    results = {"command": " ".join(sys.argv), "torch": torch.__version__, "layers": args.layers,
               "adapter": args.adapter,
               "recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None),
               "shared": rounds(work / "model", work, args.adapter, True),
               "plain": rounds(work / "model", work, args.adapter, False)}
    results["recompile_limit_set"] = getattr(torch._dynamo.config, "recompile_limit", None)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
