# The two set-up commands of the README: `make demo` and `make test`.
# Each bootstraps a local virtual environment (.venv) from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest gpu-test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,plot,torch,ptx]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rtmem demo --out out/demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

# The CPU suite on the oldest versions pyproject.toml admits (constraints-oldest.txt),
# in its own environment; needs python3.10 and ~4 GB for torch's CUDA build.
PYTHON_OLDEST ?= python3.10
OLDEST := .venv-oldest
test-oldest:
	$(PYTHON_OLDEST) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q -c constraints-oldest.txt -e '.[test,plot,torch]'
	$(OLDEST)/bin/python -m pytest -q -n 2 tests

gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

bench: $(STAMP)
	$(PY) bench/simulate.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
