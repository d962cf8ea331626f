"""The same command gives the same weights: MKL's reproducible mode is on in every process, and repetition agrees.

See scripts/dtbook/reproducibility.py for the cause (MKL choosing GEMM code paths at run time) and
scripts/ch3_repeatability.py for the harness. Kill-and-resume bit-exactness is tested in test_train.py.
Three repeated runs of the harness (one weights hash) are asserted by the quick run of
notebooks/ch3_ddp/09_reproducibility.ipynb, with the same arguments, so they are not launched again here.
"""

import re

from support import run_python, run_torchrun

ONE_STEP = ["--model", "tiny", "--corpus-tokens", "5000", "--max-steps", "1", "--batch-size", "4"]


def cnr_modes(output: str) -> set[str]:
    """The reproducibility mode MKL reports on each GEMM it logs (MKL_VERBOSE=1)."""
    return set(re.findall(r"MKL_VERBOSE SGEMM.* CNR:(\S+)", output))


def test_every_worker_multiplies_in_mkls_reproducible_mode():
    """Started plainly by torchrun, with no MKL_CBWR in the environment, the workers set it themselves."""
    done = run_torchrun("ch3_train.py", *ONE_STEP, env={"MKL_VERBOSE": "1", "MKL_CBWR": None})
    assert cnr_modes(done.output) == {"AUTO,STRICT"}


def test_a_readers_own_setting_is_kept():
    """The control: MKL reports another mode when asked for one, so the test above can tell them apart."""
    done = run_python("ch3_train.py", *ONE_STEP, env={"MKL_VERBOSE": "1", "MKL_CBWR": "COMPATIBLE"})
    assert cnr_modes(done.output) == {"COMPATIBLE"}
