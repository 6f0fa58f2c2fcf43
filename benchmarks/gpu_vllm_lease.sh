#!/usr/bin/env bash
# vLLM on a lent GPU machine (issue 26, goal 3: vLLM >= 5x the transformers engine's tokens/s; and the GRPO
# round against TRL's GRPOTrainer with vLLM colocated, as the issue states it). Calls back to back (a machine
# stays warm 30 s after a call; a cold one starts bare, without what earlier calls left in /tmp):
#
#   python3 benchmarks/vllm_gpu_carry.py          # here, once: makes .vllm-carry-1/ .. -N/ (git-ignored)
#   device tool:
#     run(command="bash benchmarks/gpu_vllm_lease.sh stash", carry=[".vllm-carry-1"])    ... each part but the last
#     run(command="bash benchmarks/gpu_vllm_lease.sh", carry=[".vllm-carry-N", ".whl"], timeout_s=600)
#     run(command="bash benchmarks/gpu_vllm_lease.sh rounds", timeout_s=600)
#
# stash: copies the parts carried in this call to /tmp/vllm-parts (outside the working tree, which each call
#   replaces) and says which of the N are there.
# (no argument): stashes too; once all N are there, joins them (checking the manifest's sha256), installs the
#   wheels (and .whl/'s: trl, datasets; see benchmarks/gpu_lease.sh) into /tmp/site with pip --no-deps, checks
#   that vLLM imports, and runs benchmarks/gpu.py's generation section (the transformers engine against vLLM).
#   A missing part (the machine went cold between calls) is named, and nothing else runs: carry it again.
# rounds: on the same warm machine, benchmarks/gpu.py --vllm-rounds: TRL's GRPOTrainer with vllm_mode
#   colocate, then posttrain's rounds with rollout.engine vllm beside the optimizer, each in a process of its
#   own (vLLM does not give all its GPU memory back inside a process), then the two ratios against the goals.
# Each gpu.py process has SECTION_TIMEOUT_S (default 240) and its own JSON: $OUT/gpu-vllm-generation.json,
# gpu-vllm-trl.json, gpu-vllm-rounds.json (kept in /tmp/gpu-vllm-out for the later call), vllm-summary.txt;
# also vllm-install.txt, vllm-import.txt, nvidia-smi.txt. About 4 minutes per measuring call (estimated: each
# vLLM start compiles and captures CUDA graphs, a minute or so). A dry run here (stash and join only; vLLM's
# CUDA build does not run on this machine):
#   OUT=/tmp/lease-vllm STASH=/tmp/vllm-parts-dry DRY_RUN=1 bash benchmarks/gpu_vllm_lease.sh
set -uo pipefail
: "${OUT:?the device tool sets OUT}"
MODE=${1:-generation}
PYTHON=${PYTHON:-python3}
STASH=${STASH:-/tmp/vllm-parts}
SITE=${SITE:-/tmp/site}
KEEP=/tmp/gpu-vllm-out
mkdir -p "$KEEP"

run_gpu() {  # run_gpu NAME SECTIONS: one gpu.py process on the kept model folder
    timeout "${SECTION_TIMEOUT_S:-240}" "$PYTHON" benchmarks/gpu.py --out "$KEEP/$1.json" --budget-s 200 \
        --model-cache /tmp/gpu-bench-model --vllm-rounds 3 --only "$2" ${EXTRA_ARGS:-} 2>&1 | tail -25
    cp "$KEEP/$1.json" "$OUT/" 2>/dev/null
}

if [ "$MODE" = rounds ]; then
    if [ -z "${DRY_RUN:-}" ] && [ ! -d "$SITE/vllm" ]; then
        echo "vLLM is not installed in $SITE: the machine went cold since the install call; start again" >&2
        exit 5
    fi
    export PYTHONPATH=$SITE:.
    run_gpu gpu-vllm-trl environment,vs_trl_vllm
    run_gpu gpu-vllm-rounds environment,prefetch_vllm
    "$PYTHON" benchmarks/gpu.py --summarize-vllm "$KEEP" | tee "$OUT/vllm-summary.txt"
    exit 0
fi

mkdir -p "$STASH"
for folder in .vllm-carry-*/; do
    [ -d "$folder" ] && cp "$folder"/part-* "$folder"/manifest.json "$STASH"/
done
if [ ! -f "$STASH/manifest.json" ]; then
    echo "no .vllm-carry-N/ carried in this call or before: run python3 benchmarks/vllm_gpu_carry.py here first" >&2
    exit 2
fi
parts=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['parts'])" "$STASH/manifest.json")
missing=""
for ((i = 1; i <= parts; i++)); do
    [ -f "$(printf '%s/part-%02d' "$STASH" "$i")" ] || missing="$missing $i"
done
echo "parts in $STASH: $(cd "$STASH" && ls part-* | tr '\n' ' ')(of $parts)"
[ "$MODE" = stash ] && exit 0
if [ -n "$missing" ]; then
    echo "missing part(s):$missing -- the machine went cold between calls; carry .vllm-carry-N for each again" >&2
    exit 3
fi
cat "$STASH"/part-* > "$STASH/vllm-wheels.tar"
"$PYTHON" - "$STASH" <<'EOF' || exit 4
import hashlib, json, sys
from pathlib import Path
stash = Path(sys.argv[1])
want = json.loads((stash / "manifest.json").read_text())["sha256"]
got = hashlib.sha256((stash / "vllm-wheels.tar").read_bytes()).hexdigest()
print("joined tar sha256", "ok" if got == want else f"MISMATCH: {got} != {want}")
sys.exit(0 if got == want else 1)
EOF
tar -xf "$STASH/vllm-wheels.tar" -C "$STASH"
# .whl/'s wheels (trl, datasets, ...) unless the vLLM set already has that project (two versions stop pip).
wheels=("$STASH"/vllm-wheels/*.whl)
for wheel in .whl/*.whl; do
    [ -f "$wheel" ] || continue
    project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')
    compgen -G "$STASH/vllm-wheels/${project}-*.whl" > /dev/null || wheels+=("$wheel")
done
if [ -n "${DRY_RUN:-}" ]; then
    echo "dry run: would install ${#wheels[@]} wheels into $SITE" | tee "$OUT/vllm-install.txt"
    exit 0
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" 2>&1 | tail -5 | tee "$OUT/vllm-install.txt"
export PYTHONPATH=$SITE:.
"$PYTHON" -c "import torch, vllm, vllm.entrypoints.llm; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
    2>&1 | tail -20 | tee "$OUT/vllm-import.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
run_gpu gpu-vllm-generation environment,peak,generation
