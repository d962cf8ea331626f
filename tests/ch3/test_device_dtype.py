"""MinimalDDP (scripts/ch3_minimal_ddp.py) follows the model's dtype and device.

Section 3.1 runs it in float32 on the CPU. Here: (a) in float64 on 2 processes, its averaged
gradients against one process's on the whole batch, to float64's resolution
(tests/dtype_worker.py); (b) a float64 model on the meta device wrapped in this process, a
forward and backward run, every gradient, bucket and broadcast tensor on meta and in float64.
"""

import torch

from dtbook.model import GPT, GPTConfig
from support import (
    assert_float64_agreement,
    assert_on,
    float64_runs,
    load_script,
    world_without_communication,
)

CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=16)


def test_in_float64_minimal_ddp_averages_what_one_process_computes(tmp_path):
    runs = float64_runs("ch3", tmp_path)
    assert runs["MinimalDDP"]["float64"]["buckets"] > 1  # the flat buckets are exercised
    assert_float64_agreement("MinimalDDP", runs["MinimalDDP"])


def test_minimal_ddp_stays_on_the_models_device():
    program = load_script("ch3_minimal_ddp.py")
    with torch.device("meta"):
        model = GPT(CFG).to(torch.float64)
    x = torch.zeros(2, CFG.context, dtype=torch.long, device="meta")
    with world_without_communication(rank=0, world=2) as communicated:
        ddp = program.MinimalDDP(model, bucket_cap_mb=0.01)
        loss = ddp(x, x)
        loss.backward()
    params = list(model.parameters())
    # communicated: rank 0's weights broadcast, then every bucket's flat gradients
    assert_on("meta", torch.float64, params=params, grads=[p.grad for p in params],
              loss=[loss], communicated=communicated)
    assert len(communicated) == len(params) + len(ddp.buckets) and len(ddp.buckets) > 1
