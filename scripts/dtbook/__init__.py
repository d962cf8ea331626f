"""dtbook: the shared plumbing of "Distributed Training with PyTorch".

The companion scripts (``scripts/chN_*.py``) teach; this package holds what more than one of them
needs, in modules named for what they hold. It is split by the process that uses it:

worker side (imported by the scripts that torchrun starts; these import torch)
    cli           one-line errors for bad input, argparse types, the flags every script shares
    distributed   backend and device choice, a world of one without a launcher, process-group set-up
    metrics       JSON-lines metrics written by rank 0, and the provenance record of a run
    model         the book's small GPT and its sizes
    data          the deterministic synthetic corpus, token windows, the rank-aware loader, defaults
    checkpoint    atomic writes, RNG state, the newest readable checkpoint, weight fingerprints
    ddp_inspect   what a DistributedDataParallel instance reports about its buckets
    progress      loss and throughput of a training loop, every N steps
    collectives   which collectives a step issues, on which groups, and the bytes they move

notebook side (imported by notebooks and tests; these never import torch)
    paths           where the repository, the scripts and the run artefacts are
    launch          run a companion script under torchrun (or plain python) and collect its metrics
    output_filters  condense torchrun's own stack traces so a worker's one-line error stays visible

One direction only: scripts and notebooks import dtbook; dtbook never imports a script, and the
worker side never imports the launcher (tests/lib/test_layering.py checks both).
"""
