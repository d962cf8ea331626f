"""dtbook: the shared plumbing of "Distributed Training with PyTorch".

The companion scripts (``scripts/chN_*.py``) teach; this package holds what more than one of them
needs, in modules named for what they hold. It is split by the process that uses it:

worker side (imported by the scripts that torchrun starts; these import torch)
    cli           one-line errors for bad input, argparse types, the flags every script shares
    reproducibility  the setting that makes CPU matrix products reproducible bit for bit (MKL_CBWR)
    distributed   backend and device choice, a world of one without a launcher, process-group set-up
    metrics       JSON-lines metrics written by rank 0, and the provenance record of a run
    model         the book's small GPT and its sizes
    data          the deterministic synthetic corpus, token windows, the rank-aware loader, defaults
    checkpoint    atomic writes, RNG state, the newest readable checkpoint, weight fingerprints
    ddp_inspect   what a DistributedDataParallel instance reports about its buckets
    comm_timing   timing collectives: rounds of back-to-back calls, the slowest rank's time

notebook side (imported by notebooks and tests; these never import torch)
    paths           where the repository, the scripts and the run artefacts are
    launch          run a companion script under torchrun (or plain python) and collect its metrics
    output_filters  condense torchrun's own stack traces so a worker's one-line error stays visible
    cost_model      the alpha-beta model of a collective's time: fit, save, load, predict (also
                    used by the benchmark that fits it; no torch)

One direction only: scripts and notebooks import dtbook; dtbook never imports a script, and the
worker side never imports the launcher (tests/lib/test_layering.py checks both).
"""
