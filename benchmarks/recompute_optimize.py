"""Recompute every optimize round of a finished run, each in a fresh process, and compare with its artifact.

A resumed run recomputes a stage alone in a new process, often on a loaded machine; its bytes must be the
uninterrupted run's or the final metrics drift (issue 13's chaos benchmark). This reruns `stages.training.grpo.run`
with each round's manifest (config, inputs) and reports how many adapters are bit-identical.

    .venv/bin/python benchmarks/recompute_optimize.py artifacts
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rerun(artifacts: Path, folder: Path, out: Path) -> None:
    """Call `stages.training.grpo.run` as the optimize round stored in `folder` was called (its manifest's config and
    inputs), writing into `out`."""
    sys.path.insert(0, str(ROOT))
    from stages.training import grpo

    manifest = json.loads((folder / "_manifest.json").read_text())
    config = dict(manifest["config"])
    round_index, temperature = config.pop("round"), config.pop("temperature")
    max_completion_length = config.pop("max_completion_length")
    cfg = grpo.GRPOConfig(**{k: v for k, v in config.items() if k in grpo.GRPOConfig.model_fields})
    inputs = manifest["inputs"]
    prev = artifacts / inputs["adapter"] if inputs.get("adapter") else None
    scored = next((artifacts / inputs["scored"]).glob("*.parquet"))
    grpo.run(cfg, artifacts / inputs["policy"], prev, scored, round_index, temperature, max_completion_length, out)


def recompute(artifacts: Path, key: str) -> bool:
    """Rerun optimize/<key> in this process; True when its adapter's bytes equal the stored ones."""
    folder = artifacts / "optimize" / key
    with tempfile.TemporaryDirectory() as out:
        rerun(artifacts, folder, Path(out))
        names = [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".pt")]
        return all(hashlib.sha256((Path(out) / n).read_bytes()).digest()
                   == hashlib.sha256((folder / n).read_bytes()).digest() for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("--key", help="recompute only this optimize key, in this process")
    args = parser.parse_args()
    if args.key:
        sys.exit(0 if recompute(args.artifacts, args.key) else 1)
    keys = sorted(p.parent.name for p in (args.artifacts / "optimize").glob("*/_manifest.json"))
    same = 0
    for key in keys:
        done = subprocess.run([sys.executable, __file__, str(args.artifacts), "--key", key], capture_output=True,
                              text=True)
        if done.returncode not in (0, 1):
            sys.exit(f"optimize/{key}: the rerun failed:\n{done.stderr[-2000:]}")
        same += done.returncode == 0
        print(f"optimize/{key}: {'bit-identical' if done.returncode == 0 else 'DIFFERS'}", flush=True)
    print(f"bit-identical: {same} of {len(keys)}")


if __name__ == "__main__":
    main()
