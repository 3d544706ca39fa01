# Every target does its own set-up: a fresh clone needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The MLX backend follows the machine: CUDA where an NVIDIA GPU answers, else the CPU
# backend on Linux; on macOS plain mlx brings Metal and both extras are empty.
BACKEND := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
EXTRAS := test,plot,$(BACKEND)

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/moestream run config/demo.toml

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/moestream bench --config config/demo.toml

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-data
