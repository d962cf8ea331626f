"""Attention kernels: F.scaled_dot_product_attention against attention written out by hand.

    python scripts/ch1_attention.py
    python scripts/ch1_attention.py --model large --seq-lens 256 512 1024 2048 --batch-size 2
    torchrun --standalone --nproc_per_node=1 scripts/ch1_attention.py

The inputs have the shape of the book's model's attention (--model gives heads and head size):
q, k and v of shape (batch, heads, sequence, head size).

1. equality   the hand-written causal attention and SDPA agree on outputs and on the gradients of
              q, k and v within a tolerance set by float32's epsilon; attention without the causal
              mask, the control, must not
2. sweep      for each sequence length, forward + backward time and the bytes saved for backward
              by the hand-written attention, SDPA as it chooses, and SDPA held to its MATH backend
3. backends   SDPA's backends (MATH, FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION), each
              forced with torch.nn.attention.sdpa_kernel on this device: which accept the call, and
              which kernel SDPA picks by itself, and the priority order it tries them in
              (torch._C._get_sdp_priority_order), by default and under set_priority=True
"""

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtbook.cli import add_backend_and_metrics, one_line, positive_int, run_main, script_parser
from dtbook.distributed import drain_gloo_workers, open_metrics, start_single_device
from dtbook.measure import AtenOps, SavedTensors, median_ms
from dtbook.model import MODEL_SIZES

BACKENDS = ["MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]
EPS = torch.finfo(torch.float32).eps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="medium",
        help="heads and head size are this model's (default: medium)")
    add("--batch-size", type=positive_int, default=4, help="sequences per call (default: 4)")
    add("--seq-lens", nargs="+", type=positive_int, default=[64, 128, 256, 512, 1024],
        help="sequence lengths of the sweep (default: 64 to 1024)")
    add("--repeats", type=positive_int, default=3, help="timed calls per point (default: 3)")
    add("--seed", type=int, default=0, help="seeds q, k and v")
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def causal_attention(q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, causal: each position sees itself and the past.

    Autograd saves the (T x T) attention weights of every head for the backward pass.
    """
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return weights @ v


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The control: the same attention without the causal mask, so the past sees the future."""
    weights = torch.softmax((q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5, dim=-1)
    return weights @ v


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


IMPLEMENTATIONS = {"hand-written": causal_attention, "SDPA": sdpa, "SDPA, MATH backend": sdpa_math}


def random_qkv(args, seq_len: int, device, dtype=torch.float32) -> list[torch.Tensor]:
    cfg = MODEL_SIZES[args.model]
    shape = (args.batch_size, cfg.n_head, seq_len, cfg.n_embd // cfg.n_head)
    gen = torch.Generator().manual_seed(args.seed)
    return [torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in "qkv"]


def output_and_grads(attention, q, k, v, weights_of_loss) -> list[torch.Tensor]:
    """The output, and the gradients of sum(output * weights_of_loss) with respect to q, k and v."""
    out = attention(q, k, v)
    grads = torch.autograd.grad((out * weights_of_loss).sum(), (q, k, v))
    return [out.detach(), *grads]


def compare(args, device) -> list[dict]:
    """Hand-written against SDPA, and the unmasked control against SDPA, tensor by tensor.

    Both compute sums of T products in different orders (SDPA's CPU and GPU kernels work block
    by block with an online softmax), so they differ by rounding: at most about T float32
    epsilons of the largest magnitude involved, the worst-case bound for a sum of T terms.
    """
    seq_len = max(args.seq_lens)
    q, k, v = random_qkv(args, seq_len, device)
    weights_of_loss = torch.randn(q.shape, generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    reference = output_and_grads(sdpa, q, k, v, weights_of_loss)
    rows = []
    for name, attention in (("hand-written", causal_attention), ("control: no causal mask", full_attention)):
        for tensor, ours, theirs in zip(["output", "dq", "dk", "dv"],
                                        output_and_grads(attention, q, k, v, weights_of_loss), reference,
                                        strict=True):
            rows.append({"implementation": name, "tensor": tensor, "seq_len": seq_len,
                         "max_abs_difference": (ours - theirs).abs().max().item(),
                         "tolerance": seq_len * EPS * theirs.abs().max().item()})
    return rows


def sweep(args, device) -> list[dict]:
    rows = []
    for seq_len in args.seq_lens:
        for name, attention in IMPLEMENTATIONS.items():
            q, k, v = random_qkv(args, seq_len, device)
            with SavedTensors() as saved:
                out = attention(q, k, v)
            del out

            def step(attention=attention, q=q, k=k, v=v):
                attention(q, k, v).sum().backward()

            rows.append({"seq_len": seq_len, "implementation": name, "saved_bytes": saved.bytes,
                         "ms": median_ms(step, args.repeats, device)})
    return rows


def backends(args, device) -> list[dict]:
    """Each SDPA backend forced in turn, in fp32 and in the low-precision dtype kernels prefer."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16 if device.type == "cpu" else torch.float16):
        q, k, v = random_qkv(args, 128, device, dtype)
        ops = AtenOps()
        with ops:
            sdpa(q, k, v)
        chosen = sorted(name for name in ops.names() if name.startswith("_scaled_dot_product"))
        for backend in BACKENDS:
            # A kernel that cannot run warns once per reason before the call fails: on a
            # GPU, a wall of UserWarnings. The reasons go into the metrics instead.
            with warnings.catch_warnings(record=True) as reasons:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        sdpa(q, k, v)
                    problem = None
                except RuntimeError as err:
                    problem = one_line(err)
            rows.append({"backend": backend, "dtype": str(dtype).removeprefix("torch."),
                         "works": problem is None, "problem": problem, "default_kernel": chosen,
                         "reasons": [one_line(w.message) for w in reasons]})
    return rows


def priority_orders() -> dict[str, list[str]]:
    """SDPA's backend priority order: the default, under sdpa_kernel(..., set_priority=True),
    and after that context has exited."""
    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper() and n != "ERROR"}

    def order():
        return [names[i] for i in torch._C._get_sdp_priority_order()]

    default = order()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        reordered = order()
    return {"default": default, "cudnn and math first": reordered, "after": order()}


def main() -> None:
    args = parse_args()
    backend, device = start_single_device(args.backend)
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    metrics.write(event="config", model=args.model, n_embd=cfg.n_embd, n_head=cfg.n_head,
                  head_dim=cfg.n_embd // cfg.n_head, batch=args.batch_size)
    print(f"attention of the {args.model} model: {cfg.n_head} heads of size {cfg.n_embd // cfg.n_head}, "
          f"batch {args.batch_size}, on {device}")

    # One line per comparison, one row per length, one line per dtype: a page-sized table.
    rows = compare(args, device)
    for name in dict.fromkeys(row["implementation"] for row in rows):
        mine = [row for row in rows if row["implementation"] == name]
        for row in mine:
            metrics.write(event="equality", **row)
        inside = all(row["max_abs_difference"] <= row["tolerance"] for row in mine)
        print(f"  {name:<24} max |diff| / tolerance: " + ", ".join(
            f"{row['tensor']} {row['max_abs_difference'] / row['tolerance']:.1e}" for row in mine)
            + (" (all within)" if inside else " (OUTSIDE)"))

    names = list(IMPLEMENTATIONS)
    print(f"\n{'seq':>6} {'saved for backward, MiB':>26} {'fwd+bwd ms':>24}   ({' / '.join(names)})")
    by_seq: dict[int, list[dict]] = {}
    for row in sweep(args, device):
        metrics.write(event="sweep", **row)
        by_seq.setdefault(row["seq_len"], []).append(row)
    for seq_len, mine in by_seq.items():
        saved = " / ".join(f"{r['saved_bytes'] / 2**20:.2f}" for r in mine)
        ms = " / ".join(f"{r['ms']:.1f}" for r in mine)
        print(f"{seq_len:>6} {saved:>26} {ms:>24}")

    print("\nSDPA backends on this device, each forced with sdpa_kernel:")
    by_dtype: dict[str, list[dict]] = {}
    for row in backends(args, device):
        metrics.write(event="backend", **row)
        by_dtype.setdefault(row["dtype"], []).append(row)
    for dtype, mine in by_dtype.items():
        works = ", ".join(r["backend"] for r in mine if r["works"])
        fails = {r["backend"]: r["problem"][:60] for r in mine if not r["works"]}
        print(f"  {dtype}: left to choose, SDPA ran {', '.join(mine[0]['default_kernel'])}; "
              f"forced, {works} work")
        for problem in dict.fromkeys(fails.values()):
            names = ", ".join(b for b, p in fails.items() if p == problem)
            print(f"    {names} fail: {problem}")
    orders = priority_orders()
    metrics.write(event="priority", **orders)
    for name, order in orders.items():
        print(f"  priority order, {name}: {', '.join(order)}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
