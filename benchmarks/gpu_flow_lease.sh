#!/usr/bin/env bash
# Issue 48 step 1, the prepared call for a lent GPU machine: `posttrain run` itself on the GPU, as a user starts it.
#
#   device tool: run(command="bash benchmarks/gpu_flow_lease.sh", carry=[".whl-flow"], timeout_s=540)
#
# The GPU image has torch, transformers, peft, accelerate and pyarrow, not Prefect or MLflow. .whl-flow/ (git-ignored)
# carries them as Python 3.12 wheels, made here with benchmarks/gpu_flow_wheels.sh (~52 MB, under the 64 MiB a call
# carries); pip's resolver installs them into the image's environment (what it has and fits stays).
# Then, with nothing but the config (train.device and train.precision left at auto: CUDA and bf16 there):
#   1. posttrain run configs/quickstart.yaml   (GRPO: SFT warm start, 20 rounds, transformers engine, evals)
#   2. posttrain run configs/dpo.yaml          (SFT, demo preference pairs, DPO)
#   3. pytest -m gpu tests/test_precision_pipeline.py (the bf16 run with a reward model, every stage's device)
# and benchmarks/gpu_flow_check.py reads each run back: every stage's device and precision from its manifest, the
# exported model's tensors (dtype; loaded onto the GPU and asked the eval prompts), MLflow's metrics of the run.
# Writes to $OUT: versions.txt, install.txt, grpo.txt, dpo.txt, flow-check.json, pytest-flow.txt.
# A dry run on a CPU machine (the runs cut short by GRPO_OVERRIDES and DPO_OVERRIDES, dotted overrides):
#   OUT=/tmp/lease PYTHON=.venv/bin/python FLOW_WHEELS=none GRPO_OVERRIDES="grpo.rounds=1 sft.num_train_epochs=1" \
#     DPO_OVERRIDES="sft.num_train_epochs=1 demo_pairs.num_train=64 dpo.num_train_epochs=1" bash benchmarks/gpu_flow_lease.sh
set -uo pipefail
: "${OUT:?the device tool sets OUT}"
PYTHON=${PYTHON:-python3}
FLOW_WHEELS=${FLOW_WHEELS:-.whl-flow}
export PYTHONPATH=. PYTHONUNBUFFERED=1
start=$SECONDS
if compgen -G "$FLOW_WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-cache-dir --find-links "$FLOW_WHEELS" prefect==3.7.7 fastapi==0.135.3 \
        mlflow-skinny==3.17.2 math-verify==0.9.0 gguf==0.19.0 "pydantic>=2.7" rich 2>&1 | tail -8 | tee "$OUT/install.txt"
    # TRL's trainers (SFT, DPO) and datasets, without their pins on what the image has (pyarrow, transformers)
    "$PYTHON" -m pip install -q --no-index --no-cache-dir --no-deps "$FLOW_WHEELS"/{trl,datasets,dill,multiprocess,fsspec}-*.whl \
        2>&1 | tail -4 | tee -a "$OUT/install.txt"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c "import sys, torch, transformers, peft, prefect, mlflow; print(sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'prefect', prefect.__version__, \
'mlflow', mlflow.__version__, 'trl', __import__('trl').__version__, 'pyarrow', __import__('pyarrow').__version__, 'cuda', torch.cuda.is_available())" 2>&1; } | tee "$OUT/versions.txt"
echo "install: $((SECONDS - start)) s" | tee -a "$OUT/versions.txt"
# shellcheck disable=SC2086  # $3 is a list of dotted overrides
run_config() {  # name, config, overrides: the run as a user starts it, timed, its output kept
    local t0=$SECONDS
    timeout "${RUN_TIMEOUT_S:-200}" "$PYTHON" -m flows.cli run "$2" $3 > "$OUT/$1.txt" 2>&1
    echo "exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/$1.txt"
    tail -30 "$OUT/$1.txt"
}
run_config grpo configs/quickstart.yaml "${GRPO_OVERRIDES:-}"
run_config dpo configs/dpo.yaml "${DPO_OVERRIDES:-}"
"$PYTHON" benchmarks/gpu_flow_check.py artifacts --out "$OUT/flow-check.json" 2>&1 | tail -40
timeout 120 "$PYTHON" -m pytest -q -m gpu tests/test_precision_pipeline.py -p no:cacheprovider 2>&1 | tail -25 \
    | tee "$OUT/pytest-flow.txt"
echo "whole call: $((SECONDS - start)) s"
