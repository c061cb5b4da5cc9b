# Two commands on a fresh machine:  `make run` (the default matrix) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= all

.PHONY: setup run study test test-cluster bench report clean-results llamacpp

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

run: setup
	$(BIN)/snakemake --cores $(CORES) --resources gpu=1

# Every cell the claims ledger reads, on the embedded models (config/ledger.yaml): results/claims.md
# with no row lacking a cell; about an hour on 2 cores (docs/notes/study-embedded.md)
study: setup
	$(BIN)/snakemake --configfile config/ledger.yaml --cores $(CORES) --resources gpu=1

# The pinned upstream llama.cpp for the llama.cpp engine's tests, built for this CPU once per machine
# into ~/.cache/kvarn/llamacpp (KVARN_LLAMACPP_CACHE); later runs reuse it (python -m kvarn.program.build).
llamacpp: setup
	$(BIN)/python -m kvarn.program.build > /dev/null

# The suite on TEST_WORKERS pytest-xdist workers (tests/conftest.py says how the work is split);
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup llamacpp
	$(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup

# The Slurm profile against a one-node Slurm cluster set up on this machine (root; README "On a cluster")
test-cluster: setup
	tests/cluster/slurm.sh

bench: setup
	$(BIN)/python -m bench.perf.formats
	$(BIN)/python -m bench.perf.engine

report: setup
	$(BIN)/snakemake --cores $(CORES) --resources gpu=1 --report report.html
