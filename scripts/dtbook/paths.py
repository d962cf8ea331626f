"""Where things are: the repository, the companion scripts, and the scratch space for runs."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SCRIPTS_DIR = PACKAGE_DIR.parent
REPO_ROOT = SCRIPTS_DIR.parent
RUNS_DIR = REPO_ROOT / "runs"  # run artefacts: metrics, checkpoints, traces (git-ignored)
