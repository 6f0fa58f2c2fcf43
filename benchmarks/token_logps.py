"""The optimize stage's log-softmax over the vocabulary: forward + backward time of
`stages.training.logprobs.token_logps`.

  PYTHONPATH=. .venv/bin/python benchmarks/token_logps.py [--variant posttrain|fp32-copy] [--rows 4]
                                                          [--positions 256] [--vocab 151936]
                                                          [--temperature 1.0] [--repeats 5]

For each completion token the stage takes the log-softmax of its logits over the whole vocabulary (151,936
for Qwen2.5), in fp32: at a 0.5B model's size this is a few full passes over a (rows, positions, vocab)
tensor, forward and backward, memory-bound on any device. `posttrain`: `_token_logps` as the stage runs it
(at temperature 1: log_softmax of the bf16 logits with dtype=float32, no fp32 copy, no division);
`fp32-copy`: the formulation it replaced (an fp32 copy of the logits, divided by the temperature, then
log_softmax). Prints the median seconds of forward + backward (log-probs, entropies, the logits' gradient)
over --repeats after one warm-up; run the two variants in turn and compare their printed medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fp32_copy_token_logps(logits, tokens, temperature):
    """The formulation `token_logps` replaced (tests/test_grpo_options.py keeps the same one)."""
    import torch

    log_p = torch.log_softmax(logits[:, :-1, :].float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=["posttrain", "fp32-copy"], default="posttrain")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from stages.training import logprobs

    fn = logprobs.token_logps if args.variant == "posttrain" else fp32_copy_token_logps
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.positions + 1, args.vocab) * 3).bfloat16()
    tokens = torch.randint(0, args.vocab, (args.rows, args.positions))
    weights = torch.linspace(-1, 1, args.positions)
    seconds = []
    for _ in range(args.repeats + 1):
        x = logits.clone().requires_grad_(True)
        started = time.perf_counter()
        logps, _ = fn(x, tokens, args.temperature)
        (logps * weights).sum().backward()
        seconds.append(time.perf_counter() - started)
        del x, logps
    median = statistics.median(seconds[1:])
    print(f"{args.variant}: {args.rows} x {args.positions} positions x {args.vocab} vocabulary, temperature "
          f"{args.temperature}: forward + backward median {median:.3f} s over {args.repeats} "
          f"(range {min(seconds[1:]):.3f}-{max(seconds[1:]):.3f})")


if __name__ == "__main__":
    main()
