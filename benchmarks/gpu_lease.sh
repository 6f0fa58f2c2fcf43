#!/usr/bin/env bash
# The prepared call for a lent GPU machine (issue 26): `pytest -m gpu` and benchmarks/gpu.py, in one command.
#
#   device tool: run(command="bash benchmarks/gpu_lease.sh", carry=[".whl", ".whl-flow"], timeout_s=600)
#
# The GPU image has torch, transformers, peft, accelerate and pyarrow, not trl or datasets (the TRL section).
# Carry them as Python 3.12 wheels in .whl/ (git-ignored: add `/.whl/` to .git/info/exclude), made here with
#   pip download --only-binary=:all: --python-version 3.12 --no-deps -d .whl trl==1.16.0 datasets==5.2.0 \
#       pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection dill multiprocess
# they are installed into /tmp/site; without .whl/ the TRL section records its error and the rest runs.
# .whl-flow/ (git-ignored too), optional: Prefect, MLflow (mlflow-skinny) and the rest a whole run needs, for
# the end-to-end GPU test (tests/test_precision_pipeline.py, last): pip download for Python 3.12 of
#   prefect==3.7.7 fastapi==0.135.3 mlflow-skinny==3.17.2 math-verify==0.9.0 gguf==0.19.0 rich "packaging<26.3"
# less what the image surely has at versions that fit (numpy, sympy, mpmath, regex; pydantic is in .whl/): ~52 MB,
# installed by pip's resolver from those folders into the image's environment (what it has stays).
# Writes to $OUT (set by the device tool): nvidia-smi.txt, pytest-gpu.txt and gpu.json (every section's numbers,
# rewritten after each), flow-install.txt and pytest-flow.txt. BUDGET_S (default 300): benchmark sections not
# started by then are skipped. About 9 minutes of command on an H200 (estimated from the leases before); the flow
# test runs last, so a run cut at timeout_s loses only it (gpu.json is rewritten after every section).
# EXTRA_ARGS: more benchmarks/gpu.py arguments. A dry run on a CPU machine:
#   OUT=/tmp/lease PYTHON=.venv/bin/python WHEELS=none EXTRA_ARGS="--tiny --device cpu" bash benchmarks/gpu_lease.sh
#
# What it measures, beyond the second lease (BENCHMARKS.md, issue 26): LoRA and the round against TRL with
# grpo.shared_prompt_pass false (--plain-forward: half the operators to dispatch), three rounds as the pipeline
# runs them with async prefetch (--prefetch-rounds: round k+1's rollout beside round k's optimize), in a thread
# and again in the rollout worker process (--prefetch-worker-process: generation on its own interpreter), full
# fine-tuning at 64-row micro-batches (chunked log-probs: fits an H100) and where its forward and backward spend
# the GPU's time (--profile: kernel time by operator, and how busy the GPU was), and train.compile at 64 rows after a
# warm-up of the same batch shape (the plain forward's one graph for all blocks). Sections measured before
# (full fine-tuning at 16 rows, the chunked 16-row ones, generation) are skipped.
set -uo pipefail
: "${OUT:?the device tool sets OUT}"
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
export PYTHONPATH=.
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site:.
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout 180 "$PYTHON" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt"
"$PYTHON" benchmarks/gpu.py --out "$OUT/gpu.json" --budget-s "${BUDGET_S:-300}" --plain-forward --also-micro-batch 64 \
    --logps-chunk-tokens 4096 --compile --prefetch-rounds 3 --prefetch-worker-process --profile \
    --skip optimize_full,optimize_full_chunked,optimize_lora_chunked,generation ${EXTRA_ARGS:-} 2>&1 | tail -40
FLOW_WHEELS=${FLOW_WHEELS:-.whl-flow}
if compgen -G "$FLOW_WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --find-links "$FLOW_WHEELS" --find-links "$WHEELS" prefect==3.7.7 \
        fastapi==0.135.3 mlflow-skinny==3.17.2 math-verify==0.9.0 gguf==0.19.0 rich 2>&1 | tail -5 | tee "$OUT/flow-install.txt"
    timeout 150 "$PYTHON" -m pytest -q -m gpu tests/test_precision_pipeline.py -p no:cacheprovider 2>&1 | tail -25 \
        | tee "$OUT/pytest-flow.txt"
fi
