"""dtbook: the shared plumbing of "Distributed Training with PyTorch".

The companion scripts (``scripts/chN_*.py``) teach; this package holds what more than one of them
needs, in modules named for what they hold. It is split by the process that uses it:

worker side (imported by the scripts that torchrun starts; these import torch)
    distributed   backend and device choice, a world of one without a launcher, process-group set-up
    model         the book's small GPT and its sizes
    data          the deterministic synthetic corpus, token windows, the rank-aware loader, defaults
    checkpoint    atomic writes, RNG state, the newest readable checkpoint, weight fingerprints
    ddp_inspect   what a DistributedDataParallel instance reports about its buckets
    comm_timing   timing collectives: rounds of back-to-back calls, the slowest rank's time
    measure       bytes of parameters, gradients, optimizer state and saved activations; ATen ops; step times
    progress      loss and throughput of a training loop, every N steps
    collectives   which collectives a step issues, on which groups, and the bytes they move
    timing        step times of the slowest rank, configurations taking turns

torch-free (the notebook side imports only these; workers use the first four too)
    cli             one-line errors for bad input, argparse types, the flags every script shares
    metrics         JSON-lines metrics written by rank 0, read back by notebooks and tests
    reproducibility the setting that makes CPU matrix products reproducible bit for bit (MKL_CBWR)
    cost_model      the alpha-beta model of a collective's time: fit, save, load, predict
    intervals       a profiler trace's events as intervals: merge, busy time, overlap
    capacity        what fits on a GPU and when data parallelism waits for the network (formulas)
    paths           where the repository, the scripts and the run artefacts are
    ports           free TCP ports for rendezvous
    launch          run a companion script under torchrun (or plain python) and collect its metrics
    output_filters  condense torchrun's own stack traces so a worker's one-line error stays visible
    cluster_lab     chapter 5's cluster in a box: network namespaces, a bridge, tbf-shaped links
    slurm_lab       Slurm (slurmctld, slurmd per node, munge) started on the cluster lab

One direction only: scripts and notebooks import dtbook; dtbook never imports a script, and the
worker side never imports the launcher (tests/lib/test_layering.py checks both).
"""
