# Two commands a newcomer needs:  make lab   (set up + JupyterLab on the quickstart)
#                                 make test  (set up + the whole test suite)
# and one for people changing the code:  make check  (the pure-logic tests + one smoke test per subsystem)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The torch build known good on a CPU-only machine with Python 3.11. pyproject.toml keeps a broad range;
# on a CUDA machine run e.g. `make setup TORCH=torch==2.13.0` with the index of your CUDA build.
TORCH  ?= torch==2.13.0
# The Hugging Face stack known good with it (pyproject.toml keeps broad ranges).
HF     ?= transformers==5.25.0 tokenizers==0.23.3 safetensors==0.8.0
PYTEST_ARGS ?=
# Python writing bytecode for what it imports, even where the environment says not to (many containers set
# PYTHONDONTWRITEBYTECODE=1): without it every process compiles torch's modules again.
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

.PHONY: setup lab test check bench clean

setup: $(VENV)/.installed

# pip compiles no bytecode: compiling the ~17,000 modules installed (transformers' ~400 architectures, plotly's,
# pandas', sympy's...) took ~40 s of the set-up's ~65 s on one core, and a test run imports a fraction of them,
# compiled as first imported. `make lab` and `make bench` compile them all first, on every core ($(VENV)/.compiled).
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH) $(HF)
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"
	$(WRITE_BYTECODE) $(BIN)/python -m workbench.doctor --build
	touch $@

# A notebook's kernel (and a bench) then imports without compiling, in any environment. compileall fails on the
# few files some packages ship that this Python cannot compile (pip skips them too): -qq, its status ignored.
$(VENV)/.compiled: $(VENV)/.installed
	$(BIN)/python -m compileall -qq -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	touch $@

# Jupyter refuses to run as root (containers, cloud machines) unless told; never listens beyond 127.0.0.1.
# While JupyterLab starts, the ranks' standby prepares on the other core (torch, torch._dynamo, the engine: ~2 s),
# so that the quickstart's first cell forks its ranks in ~0.3 s (python -m workbench --prepare-ahead).
lab: setup $(VENV)/.compiled
	$(BIN)/python -m workbench --prepare-ahead & \
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.open_browser=$${OPEN_BROWSER:-True} \
		$$([ "$$(id -u)" = 0 ] && echo --allow-root) notebooks/00_quickstart.ipynb

# The tests that start processes and compute; beside them the pure-logic ones (at a lower priority), then the
# process tests that mostly wait (tests/run_suite.py).
test: setup
	$(BIN)/python -m tests.run_suite $(PYTEST_ARGS)

# What starts processes (ranks, zygotes, torchrun, kernels) is left out but for one smoke test per subsystem.
check: setup
	$(WRITE_BYTECODE) $(BIN)/python -m pytest -q -m "smoke or not (processes or slow or browser)" $(PYTEST_ARGS)

BENCHES := pool engine telemetry telemetry_native checkpoint compression moe context_parallel

bench: setup $(VENV)/.compiled
	for b in $(BENCHES); do $(BIN)/python benches/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
