# The two commands a reader needs: `make book` and `make test` (and `make pdf`, to read offline).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book pdf test venv chromium slurm clean gpu-results

# Chapter 5 (and 6.5, 7's lab runs) builds a cluster in a box: Linux network namespaces, tc and
# Slurm, which need root. The build says so before it starts, and installs what it needs.
book: $(STAMP) slurm
	@echo "make book: chapter 5, 6.5 and chapter 7's lab runs need Linux and root (network namespaces, tc, Slurm)"
	$(BIN)/python tools/build_book.py

# The executed book as one PDF (_build/book/pdf/book.pdf), printed by the browser check's Chromium.
# After `make book` nothing is executed again; on a fresh clone the book is built first.
pdf: book chromium
	$(BIN)/python tools/build_pdf.py

# The tests check the book `make book` builds (_build/book): after `make book` only the tests run;
# on a fresh clone the build runs beside them.
test: $(STAMP) chromium slurm
	$(BIN)/python -m pytest tests

venv: $(STAMP)

# Every GPU result of the book on this machine's GPUs, in under 8 minutes (refused without CUDA).
gpu-results: $(STAMP)
	$(BIN)/python scripts/gpu_results.py

# The book's library (scripts/dtbook) is installed in editable mode, so notebooks and tests import it
# without path tricks; --no-build-isolation builds it with the pinned setuptools, offline.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The browser check drives Debian's Chromium through Playwright (no `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser check"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

# Chapter 5 builds a cluster in a box: network namespaces and tc (iproute2), and Debian's Slurm
# (slurm-wlm 22.05) with munge. Needs root, as the chapter does. The chapter starts and stops its
# own munged, slurmctld and slurmds with their own configuration; system services are not used.
CLUSTER_TOOLS := ip tc nsenter unshare slurmctld slurmd sbatch srun munged mungekey
slurm:
	@missing=""; for tool in $(CLUSTER_TOOLS); do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	[ -z "$$missing" ] || { \
	  echo "installing iproute2, Slurm and munge for chapter 5 (missing:$$missing)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    iproute2 util-linux slurmctld slurmd slurm-client munge; }

clean:
	rm -rf _build runs
