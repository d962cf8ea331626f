"""Chapter 1's companion scripts, imported as modules so that tests call their functions in-process.

Every property here is a few forward and backward passes of the tiny model: importing the script
once per session and calling its functions costs far less than a Python start-up per test.
"""


import pytest
import torch

from support import load_script


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models gain nothing from a second thread, and on a busy machine it costs a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def memory():
    return load_script("ch1_memory.py")


@pytest.fixture(scope="session")
def precision():
    return load_script("ch1_precision.py")


@pytest.fixture(scope="session")
def checkpointing():
    return load_script("ch1_checkpointing.py")


@pytest.fixture(scope="session")
def attention():
    return load_script("ch1_attention.py")


@pytest.fixture(scope="session")
def accumulation():
    return load_script("ch1_accumulation.py")
