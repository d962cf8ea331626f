"""Bit-for-bit reproducible CPU math: the one setting the book's programs need, and why.

PyTorch's CPU wheel computes matrix products with Intel oneMKL. Left to itself, MKL chooses among
several code paths for each GEMM at run time, by processor, by the alignment of the operands in
memory and by its own heuristics, and two paths may add the same numbers in a different order. On
some x86-64 machines the book's two-process training run then produced, for the same inputs, a
weight gradient differing in the last bit in about one run in ten; AdamW magnifies such a bit into
visibly different weights, and "kill, resume, and end with torch.equal weights" fails at random.

MKL's Conditional Numerical Reproducibility mode pins the code path: with ``MKL_CBWR=AUTO,STRICT``
MKL picks the best path for the processor once and keeps it, whatever the memory alignment (STRICT),
so the same program on the same machine with the same thread count computes the same bits. MKL reads
the variable when it runs its first routine, so it must be in the environment before the first
matrix product; :func:`require_reproducible_cpu_math` puts it there (a value the reader chose is
kept), and every companion script calls it through ``choose_backend``. The cost is measured by
``scripts/ch3_reproducibility.py --benchmark``. Run with ``MKL_VERBOSE=1`` to see ``CNR:AUTO,STRICT``
on every GEMM MKL logs.

On a GPU the equivalents are ``torch.use_deterministic_algorithms(True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and NCCL's choice of algorithm (chapter 3, section 5).
This module does not import torch.
"""

from __future__ import annotations

import os

REPRODUCIBLE_CPU_MATH = {"MKL_CBWR": "AUTO,STRICT"}


def require_reproducible_cpu_math() -> dict[str, str]:
    """Put MKL's reproducibility setting into this process's environment, unless already set.

    Returns the values in force. Must run before the process's first matrix product; child
    processes (torchrun's workers, mp.spawn's) inherit it.
    """
    for name, value in REPRODUCIBLE_CPU_MATH.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in REPRODUCIBLE_CPU_MATH}
