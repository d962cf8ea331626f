"""Chapter 8's hand-written parallelism follows the model's dtype and device.

The notebooks run every module in float32 on the CPU. A module that builds a tensor of its own
(a split layer, a receive buffer, a running maximum) without the device and dtype of what it
replaces works there and nowhere else: a float64 model fails at its first forward, a model on a
GPU gets split layers on the CPU. Here: (a) every module in float64 on 2 processes, against one
process, to float64's resolution (tests/dtype_worker.py); (b) every module built from a float64
model on the meta device, in this process, its forward and backward run where they can, every
parameter, gradient and output checked to be on meta and in float64 (a tensor made on the CPU,
or in float32, shows there).
"""

import pytest
import torch

from dtbook.model import GPT, GPTConfig
from support import (
    assert_float64_agreement,
    assert_on,
    float64_runs,
    load_script,
    world_without_communication,
)

META, DOUBLE = "meta", torch.float64
CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return float64_runs("ch8", tmp_path_factory.mktemp("ch8"))


@pytest.mark.parametrize("module", ["TensorParallelBlock", "SequenceParallelBlock", "gpipe_step",
                                    "ExpertParallelMoE", "ring_attention"])
def test_in_float64_the_module_computes_what_one_process_does(runs, module):
    assert_float64_agreement(module, runs[module])


def meta_gpt(cfg: GPTConfig = CFG) -> GPT:
    with torch.device(META):
        return GPT(cfg).to(DOUBLE)


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.zeros(batch, CFG.context, dtype=torch.long, device=META)


@pytest.mark.parametrize("split", ["hand_parallel", "hand_sequence_parallel"])
def test_tensor_and_sequence_parallel_blocks_stay_on_the_models_device(split):
    program = load_script("ch8_tensor_parallel.py")
    with world_without_communication(rank=0, world=2) as communicated:
        model = getattr(program, split)(meta_gpt())
        logits = model(tokens())
        logits.sum().backward()
        params = list(model.parameters())
        assert_on(META, DOUBLE, params=params, grads=[p.grad for p in params],
                  logits=[logits], full_gradients=program.full_gradients(model).values(),
                  communicated=communicated)
    assert model.blocks[0].qkv.weight.shape == (3 * CFG.n_embd // 2, CFG.n_embd)  # split


def test_a_middle_pipeline_stage_receives_on_the_models_device():
    # The middle stage of three both receives (activations forward, gradients backward) and
    # sends; the first never receives activations, the last ends in .item() of the loss.
    pipeline = load_script("ch8_pipeline.py")
    with world_without_communication(rank=1, world=3) as communicated:
        [stage] = pipeline.split_stages(meta_gpt(GPTConfig(**{**vars(CFG), "n_layer": 3})),
                                        3, [1])
        assert not stage.is_first and not stage.is_last
        inputs = []
        stage.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
        x = tokens()
        losses = pipeline.gpipe_step(stage, [(x, x), (x, x)], pipeline.Clock())
        params = list(stage.parameters())
        assert_on(META, DOUBLE, params=params, grads=[p.grad for p in params],
                  received=inputs, received_grads=[t.grad for t in inputs],
                  communicated=communicated)
    assert losses == [] and len(inputs) == 2


def test_expert_parallel_layer_and_its_exchange_stay_on_the_models_device():
    # The layer's forward reads the routing counts (.tolist()), values a meta tensor does not
    # have: here the layer is built, and its all-to-all runs forward and backward.
    program = load_script("ch8_experts.py")
    with torch.device(META):
        moe = program.MoE(16, 4).to(DOUBLE)
    with world_without_communication(rank=0, world=2) as communicated:
        layer = program.ExpertParallelMoE(moe)
        x = torch.zeros(8, 16, dtype=DOUBLE, device=META, requires_grad=True)
        out = program.AllToAll.apply(x, [3, 5], [6, 4])
        out.sum().backward()
    assert_on(META, DOUBLE, params=layer.parameters(), exchanged=[out], grad=[x.grad],
              communicated=communicated)
    assert out.shape == (10, 16) and len(layer.experts) == 2


def test_ring_attention_stays_on_the_device_of_its_queries():
    # Rank 1 of 2 attends to its own block (masked) and to rank 0's, passed round the ring.
    program = load_script("ch8_ring_attention.py")
    q, k, v = (torch.zeros(1, 2, 8, 4, dtype=DOUBLE, device=META, requires_grad=True)
               for _ in range(3))
    with world_without_communication(rank=1, world=2) as communicated:
        out = program.ring_attention(q, k, v)
        out.sum().backward()
    assert_on(META, DOUBLE, output=[out], grads=[q.grad, k.grad, v.grad],
              communicated=communicated)
