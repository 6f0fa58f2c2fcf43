# `make run` and `make test` each create or update .venv from pyproject.toml, then run.
# A second call installs nothing: the stamp file is newer than pyproject.toml.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test install clean-artifacts

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# torch first and explicitly: the CPU wheel, never a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/posttrain run configs/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean-artifacts:
	rm -rf artifacts/*
