"""The book's model and data: deterministic, shaped as the chapters assume, split disjointly across ranks."""

import math

import torch

from dtbook.data import corpus_windows, first_batches, rank_loader, synthetic_corpus
from dtbook.model import GPT, MODEL_SIZES


def test_the_corpus_is_a_function_of_its_seed():
    a, b, c = synthetic_corpus(5000, 256, 0), synthetic_corpus(5000, 256, 0), synthetic_corpus(5000, 256, 1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.dtype == torch.long and int(a.min()) >= 0 and int(a.max()) < 256


def test_the_corpus_has_structure_to_learn():
    """Each token has at most 4 successors: the next-token entropy is under log(4), far below log(256)."""
    tokens = synthetic_corpus(20_000, 256, 0).tolist()
    successors = {}
    for here, there in zip(tokens, tokens[1:], strict=False):
        successors.setdefault(here, set()).add(there)
    assert max(len(s) for s in successors.values()) <= 4


def test_windows_are_shifted_by_one_token():
    windows = corpus_windows(1000, 256, 64, seed=0)
    assert len(windows) == (1000 - 1) // 64
    x, y = windows[3]
    assert x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])


def test_iterating_the_windows_stops_at_the_last_one():
    windows = corpus_windows(corpus_tokens=101, vocab_size=16, context=10, seed=0)
    assert len(list(windows)) == len(windows) == 10
    for outside in (len(windows), -1):
        try:
            windows[outside]
        except IndexError:
            continue
        raise AssertionError(f"window {outside} of {len(windows)} did not raise")


def test_ranks_get_disjoint_slices_of_one_shuffle():
    windows = corpus_windows(20_000, 256, 64, seed=0)
    seen = []
    for rank in range(3):
        loader = rank_loader(windows, batch_size=4, rank=rank, world_size=3, seed=0)
        seen.append({tuple(x.tolist()) for xb, _ in loader for x in xb})
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    per_rank = len(windows) // 3 // 4 * 4
    assert all(len(s) == per_rank for s in seen)


def test_set_epoch_changes_the_order_and_starting_an_epoch_leaves_the_global_rng_alone():
    windows = corpus_windows(20_000, 256, 64, seed=0)
    loader = rank_loader(windows, batch_size=4, rank=0, world_size=2, seed=0)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = next(iter(loader))[0]
    assert torch.equal(torch.get_rng_state(), before)
    loader.sampler.set_epoch(1)
    assert not torch.equal(next(iter(loader))[0], first)


def test_first_batches_are_the_loaders_first_batches():
    windows = corpus_windows(20_000, 256, 64, seed=0)
    batches = first_batches(windows, 4, rank=1, world_size=2, seed=0, count=2, device=torch.device("cpu"))
    loader = iter(rank_loader(windows, 4, rank=1, world_size=2, seed=0))
    for x, y in batches:
        lx, ly = next(loader)
        assert torch.equal(x, lx) and torch.equal(y, ly)


def test_gpt_ties_its_head_to_the_embedding_and_starts_near_uniform():
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    assert model.head.weight is model.tok_emb.weight
    x = synthetic_corpus(2 * 64 + 1, 256, 0)[:-1].view(2, 64)
    logits = model(x)
    assert logits.shape == (2, 64, 256)
    # GPT-2 initialisation: the first loss sits near log(vocab), not several times above it.
    loss = model(x, x).item()
    assert abs(loss - math.log(256)) < 0.1 * math.log(256)


def test_model_sizes_grow():
    counts = [sum(p.numel() for p in GPT(MODEL_SIZES[n]).parameters()) for n in ("tiny", "small", "medium")]
    assert counts == sorted(counts) and len(set(counts)) == 3


def test_gpt2_small_has_gpt2_smalls_shape_and_parameter_count():
    """124,475,904 parameters: what the H100 probe of 2026-11-26 counted for this shape."""
    cfg = MODEL_SIZES["gpt2-small"]
    with torch.device("meta"):  # the shape only: no 500 MB of weights on a test machine
        model = GPT(cfg)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.context) == (12, 12, 768, 1024)
    assert sum(p.numel() for p in model.parameters()) == 124_475_904


def test_the_loss_is_computed_in_at_least_float32_and_never_below_the_models_dtype():
    # bf16 logits are scored in float32 (their softmax would lose bits); a float64 model's
    # loss stays float64, or a float64 run would be rounded to float32 at its last step. The
    # pipeline stages' loss_fn scores the logits the same way. Shapes and dtypes only: meta.
    from dtbook.pipeline import loss_fn

    cfg = MODEL_SIZES["tiny"]
    x = torch.zeros(2, 8, dtype=torch.long, device="meta")
    for dtype, loss_dtype in [(torch.float64, torch.float64), (torch.float32, torch.float32),
                              (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]:
        with torch.device("meta"):
            model = GPT(cfg).to(dtype)
        assert model(x, x).dtype == loss_dtype, dtype
        assert loss_fn(model(x), x).dtype == loss_dtype, dtype
