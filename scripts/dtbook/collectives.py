"""Which collectives a piece of training code issues, on which process group, and how many bytes move.

``CollectiveLog`` is a ``TorchDispatchMode``. PyTorch routes every collective through its dispatcher
as a ``c10d`` operator: DDP's all-reduce from inside its C++ reducer, FSDP's all-gathers and
reduce-scatters, a plain ``dist.broadcast``. The mode sees each one on the thread that issues it
(on the CPU, autograd runs backward on the calling thread), records the operator, the ranks of its
process group and its size, and lets it run unchanged. DTensor issues *functional* collectives
(``_c10d_functional`` operators, the group named by a string); those are recorded the same way.
It can also mark where modules' forward and backward begin, so the log reads as a timeline of one
step.

Sizes follow the usual convention for bandwidth accounting: ``bytes`` is the size of the full
tensor the collective is about (the all-reduced gradient, the all-gathered parameters, the input of
a reduce-scatter), and ``traffic_bytes`` is what a bandwidth-optimal (ring) algorithm makes each
rank send: 2(n-1)/n x bytes for all-reduce, (n-1)/n x bytes for all-gather, reduce-scatter and
broadcast, for a group of n ranks; a point-to-point ``send`` sends its tensor, all of it; an
``all_to_all`` (``bytes``: this rank's input) sends the rows its split sizes address to others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d operator name -> (collective, how the full size follows from its arguments)
KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",  # point to point: a pipeline's activations and their gradients
    "alltoall_base_": "all_to_all",  # all_to_all_single: an expert layer's tokens
}
# The functional collectives DTensor issues (torch.distributed._functional_collectives), whose last
# argument names the group: operator name -> collective.
FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


def ring_traffic(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes each rank sends when a ring algorithm runs ``kind`` on ``nbytes``
    bytes."""
    if group_size == 1:
        return 0.0
    if kind == "send":  # one rank to one other: every byte leaves
        return float(nbytes)
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if kind == "all_reduce" else share * nbytes


def _tensor_bytes(tree) -> list[int]:
    return [t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _full_bytes(kind: str, args: tuple, group_size: int) -> int:
    """The size of the full tensor: all-gather output, reduce-scatter input, all-reduce/broadcast data."""
    if kind == "all_gather":  # arguments: outputs, inputs; each rank contributes one input
        return group_size * sum(_tensor_bytes(args[1]))
    if kind == "reduce_scatter":  # arguments: outputs, inputs; each rank keeps one output
        return group_size * sum(_tensor_bytes(args[0]))
    return sum(_tensor_bytes(args[0]))


def _all_to_all_traffic(args: tuple, group) -> float:
    """Bytes of an all_to_all_single's input that go to other ranks: all but the rows
    its input split sizes (or, without them, an equal share) keep on this rank."""
    _, source = args[0], args[1]
    splits, rows = list(args[4]), source.shape[0] if source.dim() else 0
    if rows == 0:
        return 0.0
    kept = splits[group.rank()] if splits else rows // group.size()
    return float((rows - kept) * source.numel() // rows * source.element_size())


class CollectiveLog(TorchDispatchMode):
    """Record every collective issued while active (optionally with module forward/backward marks).

    ``with CollectiveLog(marks={"blocks.0": block}) as log: ...`` then ``log.events`` is the timeline
    and ``log.summary()`` the totals per collective.
    """

    def __init__(self, marks: dict[str, nn.Module] | None = None):
        super().__init__()
        self.events: list[dict] = []
        self.marks = marks or {}
        self._handles = []

    def __enter__(self):
        for name, module in self.marks.items():
            self._handles.append(module.register_forward_pre_hook(self._marker("forward", name)))
            self._handles.append(module.register_full_backward_pre_hook(self._marker("backward", name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def _marker(self, phase: str, name: str):
        def hook(*_):
            self.events.append({"kind": phase, "module": name})
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func, args)
        elif func.namespace == "_c10d_functional" and func._opname in FUNCTIONAL_KINDS:
            self._record_functional(func, args)
        return func(*args, **kwargs)

    def _record_functional(self, func, args: tuple) -> None:
        """A functional collective (what DTensor issues): its group is named by a string."""
        kind = FUNCTIONAL_KINDS[func._opname]
        group = dist.distributed_c10d._resolve_process_group(args[-1])
        ranks = dist.get_process_group_ranks(group)
        tensor = args[0]
        nbytes = tensor.numel() * tensor.element_size()
        if kind == "all_gather":  # the input is one rank's share of the full tensor
            nbytes *= len(ranks)
        self.events.append({"kind": "collective", "op": kind, "group": ranks,
                            "dtype": str(tensor.dtype).removeprefix("torch."),
                            "bytes": nbytes, "traffic_bytes": ring_traffic(kind, nbytes, len(ranks))})

    def _record(self, func, args: tuple) -> None:
        op_name = func._opname
        kind = KINDS.get(op_name)
        group = next((dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)), None)
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        if kind is None:
            self.events.append({"kind": "collective", "op": op_name, "group": ranks, "bytes": 0,
                                "traffic_bytes": 0.0})
            return
        dtypes = {t.dtype for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        nbytes = _full_bytes(kind, args, len(ranks))
        traffic = (_all_to_all_traffic(args, group) if kind == "all_to_all"
                   else ring_traffic(kind, nbytes, len(ranks)))
        self.events.append({"kind": "collective", "op": kind, "group": ranks,
                            "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "mixed",
                            "bytes": nbytes, "traffic_bytes": traffic})

    def collectives(self) -> list[dict]:
        return [e for e in self.events if e["kind"] == "collective"]

    def summary(self) -> dict[str, dict]:
        """Per collective: how many were issued, their full bytes and each rank's ring traffic."""
        totals: dict[str, dict] = {}
        for event in self.collectives():
            row = totals.setdefault(event["op"], {"count": 0, "bytes": 0, "traffic_bytes": 0.0})
            row["count"] += 1
            row["bytes"] += event["bytes"]
            row["traffic_bytes"] += event["traffic_bytes"]
        return totals
