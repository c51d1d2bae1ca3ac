# probjax: two user commands, each self-contained on a fresh machine.
#
#   make run    the attention report for this machine (python -m probjax.attention_report: a progress
#               bar, one table per case, reports/attention_report.{json,png})
#   make test   the test suite without the slow cases (pytest -q -n 2 -m "not slow")
#   make test-slow  the slow cases (pytest -q -n 2 -m slow): marked where each test is defined,
#               with the reason; CI runs both, this one with -k "not thorough" (the cases
#               marked thorough repeat other slow cases at more sizes)
#   Both share JAX's persistent compilation cache (tests/conftest.py; PROBJAX_TEST_JAX_CACHE=off
#   turns it off).
#
# Both create .venv with a Python >= 3.12 found on this machine (override with
# PYTHON=/path/to/python3.12), install `pip install -e .[test,bench]` when
# pyproject.toml changed (a stamp file holds its hash), then run.
# Extra arguments: make run ARGS="--quick", make test PYTEST_ARGS="-k masks".

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.probjax-install-stamp
PYTHON      ?=
ARGS        ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
PYTEST_MARK ?= not slow

.PHONY: help run test test-slow bench-cpu docs docs-site venv clean

help:
	@echo "make run    - attention report on this machine (ARGS=\"--quick\" etc.)"
	@echo "make test   - test suite without slow cases, pytest -q -n $(PYTEST_WORKERS) (PYTEST_ARGS=... to pass more)"
	@echo "make test-slow - the slow cases, thorough ones included (CI: PYTEST_ARGS='-k \"not thorough\"')"
	@echo "make bench-cpu - CPU benchmark JSON (bench/results/cpu/)"
	@echo "make docs   - figures and README performance section from the JSON"
	@echo "make docs-site - the documentation site into site/ (mkdocs build --strict; the docs extra)"
	@echo "make venv   - only create/refresh $(VENV)"

# probjax/attention_report.py: a progress bar naming the case and the implementation, a table per
# case (the default flagged only against the other implementations), the JSON and a PNG beside it.
run: venv
	$(PY) -m probjax.attention_report $(ARGS)

# pytest's exit code 5 (no tests collected) is a failure here, as every other non-zero code.
test: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "$(PYTEST_MARK)" $(PYTEST_ARGS)

test-slow: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m slow $(PYTEST_ARGS)

# torch (CPU build) runs in its own interpreter, .torchenv (torch 2.13.0 wheels exist for
# the system python3); without it the torch_cpu rows are recorded as missing.
bench-cpu: venv
	@if [ ! -x .torchenv/bin/python ]; then \
	  echo "creating .torchenv (torch==2.13.0 CPU, for the torch_cpu rows)"; \
	  ( python3 -m venv .torchenv && .torchenv/bin/pip install -q torch==2.13.0 numpy ) \
	    || { echo "warning: could not create .torchenv; torch_cpu rows will be missing" >&2; rm -rf .torchenv; }; \
	fi
	JAX_PLATFORMS=cpu $(PY) -m bench.benchmark_kernel_attn_cpu --device cpu

# Figures and pages (docs/dev/attention-performance.md, docs/dev/h200.md, docs/dev/figures/; the other
# ops' and layers' pages, docs/dev/*-performance.md) and README's performance section, all from the
# JSON in bench/results/.
docs: venv
	$(PY) -m bench.benchmark_figures
	$(PY) -m bench.ops_pages
	$(PY) -m bench.cpu_readme_numbers

# The documentation site (mkdocs.yml: the user guide in docs/, the API reference from the
# docstrings) into site/; --strict turns every warning (a broken link, a docstring mkdocstrings
# cannot read) into a failure. Installs the docs extra into $(VENV) when pyproject.toml's hash
# differs from its stamp or mkdocs is missing. NO_MKDOCS_2_WARNING silences mkdocs-material's
# end-of-life banner (not a build warning).
DOCS_STAMP := $(VENV)/.probjax-docs-stamp
docs-site: venv
	@want="$$(sha256sum pyproject.toml | cut -d' ' -f1)"; \
	if [ "$$(cat "$(DOCS_STAMP)" 2>/dev/null || true)" != "$$want" ] \
	    || ! "$(PY)" -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null; then \
	  echo "installing the docs extra into $(VENV): pip install -e .[docs]"; \
	  "$(PY)" -m pip install -q -e '.[docs]'; \
	  echo "$$want" > "$(DOCS_STAMP)"; \
	fi
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site/

# Creates (or re-creates, if its Python is missing or older than 3.12) the venv,
# and re-installs only when pyproject.toml's hash differs from the stamp's.
venv:
	@want="$$(sha256sum pyproject.toml | cut -d' ' -f1)"; \
	if [ ! -x "$(PY)" ] || ! "$(PY)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  py=""; \
	  ok() { "$$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }; \
	  cands=(); \
	  if [ -n "$(PYTHON)" ]; then cands+=("$(PYTHON)"); fi; \
	  for n in python3.13 python3.12 python3; do \
	    p="$$(command -v $$n 2>/dev/null || true)"; [ -n "$$p" ] && cands+=("$$p"); \
	  done; \
	  for p in $$(ls -d /root/.pyenv/versions/3.1[2-9]*/bin/python3.1[2-9] "$${PYENV_ROOT:-/root/.pyenv}"/versions/3.1[2-9]*/bin/python3.1[2-9] 2>/dev/null | sort -uV); do \
	    cands+=("$$p"); \
	  done; \
	  if command -v uv >/dev/null 2>&1; then \
	    p="$$(uv python find '>=3.12' 2>/dev/null || true)"; [ -n "$$p" ] && cands+=("$$p"); \
	  fi; \
	  for p in "$${cands[@]}"; do if ok "$$p"; then py="$$p"; break; fi; done; \
	  if [ -z "$$py" ]; then \
	    echo "error: probjax needs Python >= 3.12 (with the venv and ensurepip modules) to create $(VENV)." >&2; \
	    echo "  Looked for: PYTHON=..., python3.13, python3.12, python3 on PATH, /root/.pyenv/versions/3.1[2-9]*, 'uv python find'." >&2; \
	    echo "  Install one (e.g. 'pyenv install 3.12', 'uv python install 3.12', or apt python3.12-venv) or pass PYTHON=/path/to/python3.12." >&2; \
	    exit 1; \
	  fi; \
	  echo "creating $(VENV) with $$py ($$("$$py" -c 'import platform; print(platform.python_version())'))"; \
	  rm -rf "$(VENV)"; \
	  "$$py" -m venv "$(VENV)"; \
	fi; \
	if [ "$$(cat "$(STAMP)" 2>/dev/null || true)" != "$$want" ]; then \
	  echo "installing probjax into $(VENV): pip install -e .[test,bench]"; \
	  "$(PY)" -m pip install -q -e '.[test,bench]'; \
	  echo "$$want" > "$(STAMP)"; \
	fi

clean:
	rm -rf "$(VENV)" build *.egg-info reports site
