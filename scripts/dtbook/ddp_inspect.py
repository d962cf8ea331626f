"""What a DistributedDataParallel instance reports about itself: its gradient buckets."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


def bucket_sizes(ddp: DistributedDataParallel) -> list[int]:
    """Bytes in each gradient bucket of the layout DDP uses now, in all-reduce order.

    ``_get_ddp_logging_data`` is private, but it is where DDP reports the layout its
    C++ reducer chose: ``bucket_sizes`` before the first rebuild,
    ``rebuilt_bucket_sizes`` after it (DDP lays its buckets out again in the order
    gradients became ready during the first backward).
    """
    info = ddp._get_ddp_logging_data()
    sizes = info.get("rebuilt_bucket_sizes") or info["bucket_sizes"]
    return [int(s) for s in sizes.split(",")]
