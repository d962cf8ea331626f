# The two commands a reader needs: `make book` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test venv chromium slurm clean gpu-results

# Chapter 5 (and 6.5, 7's lab runs, 8.8) builds a cluster in a box: Linux network namespaces, tc and
# Slurm, as root or, for an ordinary user, in an unprivileged user namespace. Where neither works,
# those sections are built unexecuted, each saying why, and the build's summary lists them.
book: $(STAMP) slurm
	$(BIN)/python tools/build_book.py

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

# Debian's packages are installed with apt-get as root, or with `sudo -n` where the user may use
# it without a password; anyone else is told the one command an administrator runs. Distributions
# install ip, tc and Slurm's daemons in sbin, which an ordinary user's PATH leaves out.
SBIN_PATH := $(PATH):/usr/local/sbin:/usr/sbin:/sbin
APT_INSTALL = if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1); \
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
    sudo -n apt-get update -qq && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1); \
  else echo "$(2): ask an administrator to run: sudo apt-get install $(1)"; false; fi

# The browser check drives Debian's Chromium through Playwright (no `playwright install`).
chromium:
	@PATH="$(SBIN_PATH)"; command -v chromium >/dev/null 2>&1 || { \
	  echo "the browser check needs Debian's chromium"; \
	  $(call APT_INSTALL,chromium,make test opens every page in Chromium); }

# Chapter 5 builds a cluster in a box: network namespaces and tc (iproute2), and Debian's Slurm
# (slurm-wlm 22.05) with munge. The chapter starts and stops its own munged, slurmctld and slurmds
# with their own configuration; system services are not used. An ordinary user runs them in a user
# namespace, where Slurm needs uidmap's newuidmap and newgidmap (the tests run the lab as one too).
# Missing packages that cannot be installed here are named, and the sections that need them are
# built unexecuted.
CLUSTER_TOOLS := ip tc nsenter unshare slurmctld slurmd sbatch srun munged mungekey newuidmap newgidmap
CLUSTER_PACKAGES := iproute2 util-linux slurmctld slurmd slurm-client munge uidmap
slurm:
	@PATH="$(SBIN_PATH)"; missing=""; for tool in $(CLUSTER_TOOLS); do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	[ -z "$$missing" ] || { \
	  echo "chapter 5's cluster lab needs iproute2, Slurm, munge and uidmap (missing:$$missing)"; \
	  $(call APT_INSTALL,$(CLUSTER_PACKAGES),chapter 5's cluster lab and Slurm) || \
	  echo "make: the sections that need them will be built unexecuted, each saying why"; }

clean:
	rm -rf _build runs
