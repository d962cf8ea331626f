"""Before the real job: which process runs where, on which address; can all of them
talk?

    # on every node (the first node's name as the rendezvous endpoint)
    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0:29500 --rdzv-id=check scripts/ch5_cluster_check.py

Every process reports its ranks, its host, the network interface and address its
backend will use (the interface GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names;
without one, the address its host name resolves to) and where the rendezvous put the
process group's store (MASTER_ADDR:MASTER_PORT). Then one all_reduce over the whole
world shows that every process reaches every other.

--timeout bounds joining the process group and that all_reduce: a peer that cannot be
reached becomes an error after that many seconds, instead of a hang of 30 minutes
(gloo's default; NCCL's is 10).
"""

import argparse
import fcntl
import os
import socket
import struct

import torch
import torch.distributed as dist

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_float,
    run_main,
    script_parser,
)
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group

SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a network interface


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--timeout", type=positive_float, default=60,
                        help="seconds to join the process group and to finish the "
                             "all_reduce (default 60)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` on this host, or None if it has
    none."""
    request = struct.pack("256s", name[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def chosen_address(backend: str) -> tuple[str, str | None]:
    """The interface (or host name) the backend will use, and its address."""
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    name = os.environ.get(variable)
    if name:
        return f"{variable}={name}", interface_address(name)
    host = socket.gethostname()
    try:
        return f"host name {host}", socket.gethostbyname(host)
    except OSError:
        return f"host name {host}", None


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend, timeout_s=args.timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    via, address = chosen_address(backend)
    me = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
          "node_rank": int(os.environ.get("GROUP_RANK", 0)),
          "host": socket.gethostname(),
          "via": via, "address": address,
          "store": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, me)

    # One collective over the whole world proves every process on every node is
    # connected.
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    if total.item() != world_size:
        raise ScriptError(f"all_reduce counted {total.item():g} processes, "
                          f"not {world_size}")

    if rank == 0:
        metrics = open_metrics(args.metrics, backend, device)
        print(f"{'rank':>4} {'local':>5} {'node':>4}  {'host':<8} {'address':<15} "
              f"{'chosen by':<26} store")
        for who in everyone:
            metrics.write(event="process", **who)
            print(f"{who['rank']:>4} {who['local_rank']:>5} {who['node_rank']:>4}  "
                  f"{who['host']:<8} {who['address'] or '?':<15} {who['via']:<26} "
                  f"{who['store']}")
        print(f"all_reduce over the world counted {total.item():g} processes")
        metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
