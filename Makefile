# The two commands a reader needs: `make book` and `make test` (and `make pdf`, to read offline).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book pdf test venv lock chromium slurm clean gpu-results

# Chapter 5 (and 6.5, 7's lab runs, 8.8) builds a cluster in a box: Linux network namespaces, tc and
# Slurm, as root or, for an ordinary user, in an unprivileged user namespace. Where neither works,
# those sections are built unexecuted, each saying why, and the build's summary lists them.
book: $(STAMP) slurm
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

# Every GPU result of the book on this machine's GPUs in about 8 minutes, then every companion script
# once on one GPU in at most 4 more (refused without CUDA).
gpu-results: $(STAMP)
	$(BIN)/python scripts/gpu_results.py

# A Python that requirements.txt is not made for, or one without venv's ensurepip, is refused in one
# line (make's own "*** ... Stop.") before anything is created: tools/check_python.py says why.
PYTHON_PROBLEM = $(shell if command -v $(PYTHON) >/dev/null 2>&1; then $(PYTHON) tools/check_python.py 2>&1; \
  else echo "$(PYTHON) not found: name an installed Python with make venv PYTHON=python3.X"; fi)

# The book's library (scripts/dtbook) is installed in editable mode, so notebooks and tests import it
# without path tricks; --no-build-isolation builds it with the pinned setuptools, offline.
$(STAMP): requirements.txt pyproject.toml
	$(if $(PYTHON_PROBLEM),$(error $(PYTHON_PROBLEM)))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# requirements.txt: the lock of requirements.in for every supported Python (tools/check_python.py), one
# universal resolution by a pinned uv in a throwaway venv, with environment markers where a version must
# differ between Pythons. It keeps the versions requirements.txt already has wherever they still fit
# (make lock LOCK_ARGS="--upgrade-package X" moves one).
# torch's CUDA libraries (CUDA_PACKAGES) are left out, so that where pip finds a CPU build of torch
# (a local wheel, or PyTorch's CPU index) it is not made to install gigabytes of libraries it never
# loads; PyPI's own torch 2.13.0 for Linux is the CUDA build and brings them anyway. A CUDA torch from PyPI installs them
# at the versions its metadata names: torch 2.13.0 pins cuDNN, NCCL, cuSPARSELt, NVSHMEM, triton and
# cuda-toolkit==13.0.3 exactly, and cuda-toolkit pins cuBLAS, cuFFT and the others; only nvidia-nvjitlink,
# cuda-bindings (both <14) and cuda-pathfinder are ranges, resolved when torch is installed.
UV_VERSION    := 0.13.9
LOCK_PYTHON   := 3.10
CUDA_PACKAGES := cuda-bindings cuda-pathfinder cuda-toolkit nvidia-cublas nvidia-cuda-cupti \
  nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand \
  nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvjitlink \
  nvidia-nvshmem-cu13 nvidia-nvtx triton
LOCK_ARGS ?=
lock:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && "$$tmp/venv/bin/pip" install -q --disable-pip-version-check uv==$(UV_VERSION) && \
	UV_PYTHON_DOWNLOADS=never "$$tmp/venv/bin/uv" pip compile requirements.in --universal \
	  --python-version $(LOCK_PYTHON) --custom-compile-command "make lock" -o requirements.txt -q \
	  $(addprefix --no-emit-package ,$(CUDA_PACKAGES)) $(LOCK_ARGS)

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
