"""Bit-for-bit reproducible CPU math: the one setting the book's programs need, and why.

PyTorch's CPU wheel computes matrix products and vector math (exp, erf, ...) with Intel oneMKL.
Left to itself, MKL chooses among several code paths at run time, by processor, by the alignment of
the operands in memory and by its own heuristics, and two paths may add the same numbers in a
different order. On one x86-64 machine the book's two-process training run computed, for the same
inputs, a weight gradient differing in the last bit in about one run in ten (with this setting: 16
runs in 16 identical); AdamW magnifies such a bit into visibly different weights, and "kill, resume,
and end with torch.equal weights" failed at random. On the AMD EPYC (AVX2) machine the book is built
on, the same runs agree with and without the setting, and the setting changes no bit: whether a
machine shows the problem depends on its processor and MKL's choices there, so the book does not rely
on luck and pins the path everywhere.

MKL's Conditional Numerical Reproducibility mode pins the code path: with ``MKL_CBWR=AUTO,STRICT``
MKL picks the best path for the processor once and keeps it, whatever the memory alignment (STRICT),
so the same program on the same machine with the same thread count computes the same bits. MKL reads
the variable at its first BLAS or vector-math call (its random numbers, which dropout uses, do not
count), so it must be in the environment before the first
matrix product; :func:`require_reproducible_cpu_math` puts it there (a value the reader chose is
kept), and every companion script calls it through ``choose_backend``. The cost is measured by
``scripts/ch3_repeatability.py --benchmark``. Run with ``MKL_VERBOSE=1`` to see ``CNR:AUTO,STRICT``
on every GEMM MKL logs.

On a GPU the equivalents are ``torch.use_deterministic_algorithms(True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and NCCL's choice of algorithm (chapter 3, the reproducibility section).
This module does not import torch.
"""

from __future__ import annotations

import os

REPRODUCIBLE_CPU_MATH = {"MKL_CBWR": "AUTO,STRICT"}


def require_reproducible_cpu_math() -> dict[str, str]:
    """Put MKL's reproducibility setting into this process's environment, unless set.

    Returns the values in force. Must run before the process's first matrix
    product; child processes (torchrun's workers, mp.spawn's) inherit it.
    """
    for name, value in REPRODUCIBLE_CPU_MATH.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in REPRODUCIBLE_CPU_MATH}
