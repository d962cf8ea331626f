"""Measuring one device: the bytes a training step holds, the kernels that ran, and step times.

Chapter 1 counts memory as the bytes of tensors, never as the process's resident memory (RSS):
RSS depends on the allocator, on freed-but-cached pages and on everything else the process did,
while the bytes of the tensors a step holds are exact and the same on every run and every CPU.
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr()


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: a DTensor's local shard, say.

    A wrapper subclass (DTensor) has no storage of its own; what it keeps in memory is
    the tensors it wraps, which ``__tensor_flatten__`` names.
    """
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)  # DTensor names its mesh too
    return [t for x in inner if isinstance(x, torch.Tensor) for t in _plain_tensors(x)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views and tied weights count once."""
    sizes = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def parameter_bytes(model: torch.nn.Module) -> int:
    return storage_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor the optimizer keeps per parameter (AdamW: exp_avg, exp_avg_sq and step)."""
    return storage_bytes(t for state in optimizer.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor))


class SavedTensors:
    """The tensors autograd saves for backward while the block runs, each storage
    once.

        with SavedTensors(exclude=model.parameters()) as saved:
            loss = model(x, y)
        saved.bytes, saved.bytes_by_dtype()

    A ``saved_tensors_hooks`` pack hook sees every tensor an autograd node stores.
    Several nodes often save the same storage (q, k and v are views of one qkv
    output), so storages are keyed by address; that is sound because every saved
    storage stays alive until backward frees it. Every linear layer saves its weight,
    but parameters are counted as parameters: ``exclude`` them. The hook cannot see
    memory kept outside autograd's nodes, such as the cache of selective activation
    checkpointing; MemTracker (torch.distributed._tools.mem_tracker) sees that too.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        plain = [p for t in exclude for p in _plain_tensors(t)]
        self._excluded = {_storage_key(p) for p in plain}
        self.storages: dict[tuple, tuple[int, torch.dtype]] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in _plain_tensors(tensor):  # a DTensor: its local shard
            key = _storage_key(plain)
            if key not in self._excluded:
                self.storages[key] = (plain.untyped_storage().nbytes(), plain.dtype)
        return tensor

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.storages.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for size, dtype in self.storages.values():
            name = str(dtype).removeprefix("torch.")
            totals[name] = totals.get(name, 0) + size
        return totals


class SavedTensorsByRegion(SavedTensors):
    """``SavedTensors``, split by where each storage was saved: while one of the named
    groups of modules ran its forward, or elsewhere (``"other"``).

        norms = [m for block in model.blocks for m in (block.ln1, block.ln2)]
        with SavedTensorsByRegion({"norms": norms}, model.parameters()) as saved:
            loss = model(x, y)
        saved.bytes_by_region()  # {"norms": ..., "other": ...}

    Forward pre- and post-hooks on the modules say which region is running; a storage
    counts where it was first saved.
    """

    def __init__(self, regions: dict[str, Iterable[torch.nn.Module]],
                 exclude: Iterable[torch.Tensor] = ()):
        super().__init__(exclude)
        self._regions = {name: list(modules) for name, modules in regions.items()}
        self.region_of: dict[tuple, str] = {}
        self._region, self._handles = "other", []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in _plain_tensors(tensor):
            self.region_of.setdefault(_storage_key(plain), self._region)
        return super()._pack(tensor)

    def _enter(self, region: str):
        def hook(*_):
            self._region = region
        return hook

    def __enter__(self) -> SavedTensorsByRegion:
        for name, modules in self._regions.items():
            for module in modules:
                self._handles += [module.register_forward_pre_hook(self._enter(name)),
                                  module.register_forward_hook(self._enter("other"))]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def bytes_by_region(self) -> dict[str, int]:
        totals = dict.fromkeys([*self._regions, "other"], 0)
        for key, (size, _) in self.storages.items():
            totals[self.region_of[key]] += size
        return totals


class AtenOps(TorchDispatchMode):
    """Records every ATen operator that runs, with the dtype of its (first) output.

    A dispatch mode sits below autograd and autocast, so it sees what really executes: the casts
    autocast inserts, the matmul in bf16, the SDPA kernel that was picked for the call.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        dtype = str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else "-"
        self.calls.append((func.overloadpacket.__name__, dtype))
        return out

    def names(self) -> set[str]:
        return {name for name, _ in self.calls}


class LiveStoragePeak(TorchDispatchMode):
    """The most bytes of storage that the ops run inside it held alive at once.

        with LiveStoragePeak() as live:
            model(x, y).backward()
        live.peak_bytes
        live.bytes_at_peak(model.parameters())  # what part of the peak those tensors were

    A second, independent way to measure a step's peak: every ATen op's outputs are
    recorded with a weak reference to their storage, and a storage counts from the op
    that first returned it until its last tensor dies. A storage is counted whoever
    allocated it: a tensor made before the mode entered (a parameter) is not counted
    by itself, but an op that returns a view of it (``aten.t`` of a Linear weight, the
    transposed weight of a tied head; ``aten.detach`` of the layer-norm weights and biases
    that a checkpoint recomputation saves) returns its storage, which then counts in full.
    A parameter that ops only read (an embedding table, a bias added by ``addmm``) does not.
    A kernel's scratch memory is not counted. It shares no code with MemTracker, so a
    figure both report is not an artifact of either.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0
        self._at_peak: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Drop what died since the last op; the weak reference keeps the key unique.
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, tensor.untyped_storage().nbytes())
        now = sum(size for _, size in self.live.values())
        if now > self.peak_bytes:
            self.peak_bytes = now
            self._at_peak = {k: size for k, (_, size) in self.live.items()}
        return out

    def bytes_at_peak(self, tensors) -> int:
        """The bytes of ``tensors``' storages (each once) that the peak counted."""
        keys = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors}
        return sum(size for k, size in self._at_peak.items() if k in keys)

    def tensors_at_peak(self, named: dict[str, torch.Tensor]) -> list[str]:
        """The names in ``named`` whose storage the peak counted."""
        return [name for name, t in named.items()
                if StorageWeakRef(t.untyped_storage()).cdata in self._at_peak]


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls.

    On CUDA, kernels run asynchronously: synchronize before reading the clock, or the time measured
    is only how long it took to queue the work.
    """
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


PR_SET_THP_DISABLE = 41  # linux/prctl.h


def fault_in_base_pages() -> None:
    """From now on this process maps fresh memory in base pages (4 KiB on x86), one fault each.

    Under transparent huge pages set to "always" (the default of some distributions; Debian's
    is "madvise") one fault can map 2 MiB, and a count of faults would no longer be a count of
    pages. The flag is the process's own (prctl, Linux 3.15+); elsewhere nothing changes.
    """
    if sys.platform == "linux":
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # the kernel's signature
        if prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_THP_DISABLE): {os.strerror(err)}")


def page_faults_per_call(fn, calls: int = 3) -> float:
    """Minor page faults per call of ``fn`` in this process (its threads included, gloo's
    workers too): the pages of fresh memory a call touches. One warm-up call first."""
    fault_in_base_pages()
    fn()
    dist.barrier()  # every rank counts the same calls
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
