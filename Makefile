# Every target does its own set-up: a fresh clone needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The MLX backend follows the machine: CUDA where an NVIDIA GPU answers, else the CPU
# backend on Linux; on macOS plain mlx brings Metal and both extras are empty.
BACKEND := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: demo test lint bench clean

# One stamp per set of extras: the demo does not need the test tools (torch among them).
$(VENV)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(subst +,$(comma),$*)]"
	touch $@

comma := ,
RUNTIME := $(VENV)/.installed-plot+$(BACKEND)
TESTING := $(VENV)/.installed-test+plot+$(BACKEND)

demo: $(RUNTIME)
	$(BIN)/moestream run config/demo.toml

# The type checker reads [tool.mypy] in pyproject.toml (the product packages).
test: $(TESTING)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -x -n 2 --durations=15

lint: $(TESTING)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The demo container (made by `make demo`, or here on first use), at the demo's pool.
bench: $(RUNTIME)
	test -f demo-data/demo.qpack/manifest.json || $(BIN)/moestream run config/demo.toml --max-tokens 1 --set 'run.prompts=["Hi"]' --set run.stats=demo-data/prepare-stats.json
	$(BIN)/moestream bench demo-data/demo.qpack --pool-mb 24 --prefill-chunk 128 --json demo-data/bench.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-data
