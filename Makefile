# Two commands on a fresh machine:  `make run` (the default matrix) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= all

.PHONY: setup run study perlayer test test-cluster bench report report-snakemake browser clean-results llamacpp

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

# Which layers deserve the bits (docs/notes/per-layer.md): per-layer sensitivities and the search on
# Wikitext-2 valid, judged on test against the study matrix's uniform cells: results/perlayer/perlayer.md
perlayer: setup
	$(BIN)/snakemake perlayer --configfile config/ledger.yaml config/perlayer.yaml --cores $(CORES) --resources gpu=1

# The pinned upstream llama.cpp for the llama.cpp engine's tests, built for this CPU once per machine
# into ~/.cache/kvarn/llamacpp (KVARN_LLAMACPP_CACHE); later runs reuse it (python -m kvarn.llamacpp_engine.build).
llamacpp: setup
	$(BIN)/python -m kvarn.llamacpp_engine.build > /dev/null

# The suite on TEST_WORKERS pytest-xdist workers (tests/conftest.py says how the work is split);
# TEST_WORKERS=0 runs it in one process. The pinned llama.cpp is built (once per machine) by the first
# test that needs it, on the worker that holds the llama.cpp engine's tests, while the other worker runs
# the rest: the build overlaps the tests that do not need it (`make llamacpp` builds it alone).
TEST_WORKERS ?= 2
test: setup browser
	$(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup

# The Slurm profile against a one-node Slurm cluster set up on this machine (root; README "On a cluster")
test-cluster: setup
	tests/cluster/slurm.sh

bench: setup
	$(BIN)/python -m bench.perf.formats
	$(BIN)/python -m bench.perf.forward_speed

# Debian's chromium, which tests/test_page.py loads the report page in (headless): installed with apt-get
# when `chromium` is not on PATH (as root; otherwise the command to run is printed and make stops).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "chromium is not installed: run 'sudo apt-get install -y chromium' (Debian), then make again" >&2; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { \
	    echo "chromium is not installed and there is no apt-get: install Debian's chromium package" >&2; exit 1; }; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }
	@command -v chromium >/dev/null 2>&1 || { echo "chromium is still not on PATH after apt-get" >&2; exit 1; }

# The landing page (results/report.html, rule report_page: the answer first, then the claims ledger, the
# figures, retrieval and per-layer results where they exist), built from the run's results (running what
# is missing, as `make run` does) and copied to report.html: one self-contained file.
report: setup
	$(BIN)/snakemake --cores $(CORES) --resources gpu=1 --forcerun report_page -- results/report.html
	cp results/report.html report.html

# Snakemake's own report of the same results: every table and figure by category, with its caption.
report-snakemake: setup
	$(BIN)/snakemake --cores $(CORES) --resources gpu=1 --report report-snakemake.html
