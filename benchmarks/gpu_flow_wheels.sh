#!/usr/bin/env bash
# The wheels benchmarks/gpu_flow_lease.sh carries to a lent GPU machine (Python 3.12, no Prefect or MLflow there):
# what a whole run needs beside torch/transformers/peft/accelerate/pyarrow, resolved for Python 3.12, less the big
# ones the GPU image already has at versions that fit (numpy, sympy, tokenizers, huggingface_hub, ...). ~52 MB.
#   bash benchmarks/gpu_flow_wheels.sh [.whl-flow]
set -euo pipefail
dest=${1:-.whl-flow}
PYTHON=${PYTHON:-.venv/bin/python}
platforms=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux1; do platforms+=(--platform "${tag}_x86_64"); done
"$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" \
    prefect==3.7.7 fastapi==0.135.3 mlflow-skinny==3.17.2 math-verify==0.9.0 gguf==0.19.0 rich pyyaml tqdm \
    "pydantic>=2.7" tokenizers
for have in numpy sympy hf_xet tokenizers huggingface_hub pygments pyyaml regex mpmath protobuf; do
    rm -f "$dest/$have"-*.whl
done
# TRL and datasets, installed there with --no-deps (their pins on pyarrow/transformers would pull ~60 MB more)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$dest" \
    trl==1.16.0 datasets==5.2.0 "dill<0.4.2" "multiprocess<0.70.20" "fsspec<=2026.9.0"
du -sh "$dest"
