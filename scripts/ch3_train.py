"""Train a small GPT with DistributedDataParallel: the book's reference DDP program.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_train.py     # two processes
    torchrun --standalone --nproc_per_node=2 scripts/ch3_train.py --checkpoint-dir runs/ckpt --resume
    python scripts/ch3_train.py                                       # no launcher: a world of one

Every process holds a full replica of the model and trains on its own slice of
each global batch (DistributedSampler); DDP averages the gradients with
all-reduce during backward, so every replica takes the same optimizer step.
One optimizer step consumes a global batch of

    world size x --batch-size x --accum-steps   windows of 64 tokens,

and with dropout off (the default) the result depends only on that product, up
to float rounding: 2 processes x 8 train the same model as 1 process x 16.

Checkpoints (--checkpoint-dir, --save-every, --keep) hold everything a run
needs to continue bit for bit: weights, optimizer, grad scaler, the position in
the data and every process's RNG state. --resume continues from the newest
readable checkpoint (an unreadable newest one is reported and skipped); with an
empty checkpoint directory it starts from step 0, so the same command line
serves the first launch and every restart. Checkpoints that exist but none of
which can be read are an error: starting over silently would throw work away.
For fault-injection experiments, --crash-at-step N makes one process SIGKILL
itself right after optimizer step N, once: workers that torchrun restarts
(--max-restarts) run on, as they would after a real fault.

With --checkpoint-dir, SIGTERM or SIGUSR1 (what a scheduler sends before it
stops a job) ends the run at the next step boundary with a checkpoint, and the
exit status is 128 + the signal's number. --global-batch-size fixes the global
batch instead of --accum-steps: the accumulation follows from the world size, so
an elastic job that loses a node keeps training the same way.
"""

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.checkpoint import (
    atomic_save,
    capture_rng_state,
    checkpoint_paths,
    newest_loadable,
    restore_rng_state,
    weights_fingerprint,
)
from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    check_training_inputs,
    one_line,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import DEFAULTS, corpus_windows, rank_loader
from dtbook.distributed import (
    choose_backend,
    ddp_device_ids,
    drain_gloo_workers,
    fill_in_launch_variables,
    open_metrics,
    process_group_device,
)
from dtbook.model import GPT, MODEL_SIZES
from dtbook.progress import Progress

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_KEYS = {"model", "optimizer", "scaler", "step", "epoch", "step_in_epoch", "rng", "meta"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    add("--dropout", type=float, default=0.0,
        help="dropout probability; 0 (default) keeps runs comparable across world sizes")
    add("--corpus-tokens", type=positive_int, default=DEFAULTS.corpus_tokens,
        help="length of the synthetic corpus (default: 160000 tokens = 2499 windows)")
    add("--epochs", type=positive_int, default=3, help="passes over the corpus (default: 3)")
    add("--max-steps", type=positive_int, help="stop after this many optimizer steps; overrides --epochs")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
        help="windows per process per micro-step (default: 16)")
    add("--accum-steps", type=positive_int, default=1,
        help="micro-steps per optimizer step; only the last one all-reduces (default: 1)")
    add("--lr", type=positive_float, default=DEFAULTS.lr, help="AdamW learning rate (default: 0.01)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus, the initial weights and the shuffle")
    add("--amp", choices=["off", "bf16", "fp16"], default="off",
        help="autocast dtype; fp16 adds a GradScaler (default: off)")
    add("--bucket-cap-mb", type=positive_float, default=DEFAULTS.bucket_cap_mb,
        help="DDP gradient bucket size in MiB (default: 25, DDP's own default)")
    add("--checkpoint-dir", type=Path, help="where rank 0 writes checkpoints")
    add("--save-every", type=positive_int, default=50,
        help="checkpoint every N optimizer steps, and at the end (default: 50)")
    add("--keep", type=positive_int, default=2, help="how many newest checkpoints to keep")
    add("--resume", action="store_true", help="continue from the newest readable checkpoint in --checkpoint-dir")
    add("--log-every", type=positive_int, default=10, help="log the loss every N steps")
    add("--print-every", type=positive_int,
        help="print progress on the console every N steps (default: every logged step)")
    add("--save-final", type=Path, help="rank 0 writes the final model state dict here")
    add("--crash-at-step", type=positive_int,
        help="fault injection: SIGKILL one process right after this optimizer step")
    add("--crash-rank", type=int, help="the process --crash-at-step kills (default: the last rank)")
    add("--global-batch-size", type=positive_int,
        help="windows per optimizer step, all processes together; sets --accum-steps "
             "from the world size")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    args.print_every = args.print_every or args.log_every
    if args.global_batch_size and args.accum_steps != 1:
        parser.error("--global-batch-size sets --accum-steps from the world size: "
                     "give only one of them")
    return args


# --------------------------------------------------------------------------
# Checkpoints: rank 0 writes atomically, every rank reads the same file
# --------------------------------------------------------------------------


def training_state(model, optimizer, scaler, step: int, epoch: int,
                   step_in_epoch: int, meta: dict) -> dict:
    """Everything a restart needs; the RNG state is added by save_checkpoint."""
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "step": step, "epoch": epoch,
            "step_in_epoch": step_in_epoch, "meta": meta}


def save_checkpoint(ckpt_dir: Path, keep: int, state: dict, device) -> Path:
    """Collective: every rank sends its RNG state to rank 0, which writes the file
    and rotates; all wait for it."""
    rng_states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(capture_rng_state(device), rng_states, dst=0)
    path = ckpt_dir / f"ckpt_step{state['step']:08d}.pt"
    if dist.get_rank() == 0:
        try:
            atomic_save({**state, "rng": rng_states}, path)
        except OSError as err:
            raise ScriptError(f"could not write checkpoint {path}: {err}") from None
        for old in checkpoint_paths(ckpt_dir)[:-keep]:
            old.unlink()
    # Nobody runs ahead until the checkpoint exists: a failure from here on can
    # resume from it.
    dist.barrier()
    return path


def load_checkpoint(ckpt_dir: Path, device: torch.device) -> dict | None:
    """Collective: rank 0 picks the file; every rank loads it onto its device."""
    choice = [None, None]
    if dist.get_rank() == 0:
        candidates = checkpoint_paths(ckpt_dir)
        path = newest_loadable(candidates, CHECKPOINT_KEYS)
        problem = None
        if candidates and path is None:
            problem = (f"none of the {len(candidates)} checkpoint(s) in {ckpt_dir} "
                       "can be read")
        choice = [str(path) if path else None, problem]
    dist.broadcast_object_list(choice, src=0)
    path, problem = choice
    if problem:
        raise ScriptError(f"{problem}; remove them or drop --resume to start over")
    if path is None:
        return None
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:
        raise ScriptError(f"cannot read checkpoint {path} (is it on storage every "
                          f"node sees?): {one_line(err)}") from None
    ckpt["path"] = path
    return ckpt


# --------------------------------------------------------------------------
# Stopping on request: a scheduler's SIGTERM or SIGUSR1
# --------------------------------------------------------------------------


class StopRequest:
    """SIGTERM and SIGUSR1 ask the run to stop: at a step boundary, with a
    checkpoint.

    The handler only notes the signal, so the step in flight finishes. Ranks
    receive a signal at different moments (or not at all), so at every step
    boundary they agree on it with an all-reduce, and then all of them save and
    exit at the same step.
    """

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self.note)

    def note(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> int:
        """Collective: the signal any rank has received, or 0."""
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def stop_with_checkpoint(signum: int, args, state: dict, device, metrics) -> None:
    """Collective: save ``state`` (unless this step was just saved); exit 128 +
    signum."""
    name = signal.Signals(signum).name
    path = args.checkpoint_dir / f"ckpt_step{state['step']:08d}.pt"
    if state["step"] % args.save_every:
        path = save_checkpoint(args.checkpoint_dir, args.keep, state, device)
    metrics.write(event="stopped", signal=name, step=state["step"], path=str(path),
                  unix_time=time.time())
    if dist.get_rank() == 0:
        print(f"{name}: stopped after step {state['step']} with checkpoint {path}; "
              "--resume continues from it", flush=True)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()
    sys.exit(128 + signum)


# --------------------------------------------------------------------------
# Building the run
# --------------------------------------------------------------------------


def accumulation_for(global_batch: int, world_size: int, batch_size: int) -> int:
    """The --accum-steps that makes world size x --batch-size x accum =
    ``global_batch``.

    An elastic job that shrinks keeps its global batch, and with it the optimizer's
    trajectory: the remaining processes accumulate more micro-steps per step.
    """
    per_micro_step = world_size * batch_size
    if global_batch % per_micro_step:
        raise ScriptError(f"--global-batch-size {global_batch} is not a multiple of "
                          f"{world_size} process(es) x --batch-size {batch_size} = "
                          f"{per_micro_step}")
    return global_batch // per_micro_step


def build_model(args, device: torch.device, rank: int):
    """The DDP-wrapped GPT, its AdamW optimizer and its (possibly disabled) grad scaler."""
    cfg = dataclasses.replace(MODEL_SIZES[args.model], dropout=args.dropout)
    # The same seed on every rank gives the same initial weights (DDP broadcasts rank 0's anyway);
    # afterwards each rank gets its own stream, so dropout masks differ between replicas.
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    model = DDP(model, device_ids=ddp_device_ids(device), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    return model, optimizer, scaler


def resume(args, model, optimizer, scaler, meta: dict, device, metrics):
    """Load the newest readable checkpoint; return (step, epoch, step in epoch)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ckpt = load_checkpoint(args.checkpoint_dir, device)
    if ckpt is None:
        if rank == 0:
            print(f"--resume: no checkpoint in {args.checkpoint_dir} yet, "
                  "starting from step 0")
        return 0, 0, 0
    changed = {k: (ckpt["meta"][k], meta[k]) for k in meta
               if k != "world_size" and ckpt["meta"][k] != meta[k]}
    if changed:
        diff = ", ".join(f"{k} {old} vs {new}" for k, (old, new) in changed.items())
        raise ScriptError(f"checkpoint {ckpt['path']} belongs to a different run "
                          f"(checkpoint vs now: {diff})")
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    if ckpt["meta"]["world_size"] == world_size:
        restore_rng_state(ckpt["rng"][rank], device)
    elif rank == 0:
        print(f"note: checkpoint written by {ckpt['meta']['world_size']} processes; "
              "the data order continues exactly, the per-rank RNG streams do not")
    metrics.write(event="resume", path=ckpt["path"], step=ckpt["step"],
                  epoch=ckpt["epoch"])
    if rank == 0:
        print(f"resumed from {ckpt['path']} at step {ckpt['step']} "
              f"(epoch {ckpt['epoch']})")
    return ckpt["step"], ckpt["epoch"], ckpt["step_in_epoch"]


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def train_step(model, optimizer, scaler, micro_batches, args, device) -> torch.Tensor:
    """One optimizer step over --accum-steps micro-batches; returns this rank's loss."""
    autocast = torch.amp.autocast(device.type, dtype=AMP_DTYPES.get(args.amp),
                                  enabled=args.amp != "off")
    step_loss = torch.zeros((), device=device)
    for micro_step in range(args.accum_steps):
        x, y = next(micro_batches)
        x, y = x.to(device), y.to(device)
        # Gradients accumulate locally; only the last micro-step's backward all-reduces them.
        last_micro_step = micro_step == args.accum_steps - 1
        with contextlib.nullcontext() if last_micro_step else model.no_sync():
            with autocast:
                loss = model(x, y) / args.accum_steps
            scaler.scale(loss).backward()
        step_loss += loss.detach()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


def summarize(args, model, metrics, step: int, progress: Progress) -> None:
    """The run's last record: steps, first and final loss, throughput, and the weights' fingerprint."""
    fingerprint = weights_fingerprint(model.module)
    if args.save_final and dist.get_rank() == 0:
        args.save_final.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save_final)
    seconds, losses, steps_this_run = progress.train_seconds(), progress.losses, progress.steps_this_run
    samples_per_s = steps_this_run * progress.global_batch / seconds if steps_this_run else None
    final_loss = losses[-1] if losses else None
    metrics.write(event="summary", steps=step, steps_this_run=steps_this_run,
                  first_loss=losses[0] if losses else None, final_loss=final_loss,
                  train_s=seconds, samples_per_s=samples_per_s, **fingerprint)
    if dist.get_rank() == 0:
        shown = None if final_loss is None else round(final_loss, 4)
        print(f"done: step {step}, loss {shown}, {seconds:.1f} s, "
              f"weights sha256 {fingerprint['weights_sha256'][:12]}")


def main() -> None:
    args = parse_args()
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
    # without it: from Slurm's task variables under srun, else a world of one.
    fill_in_launch_variables()
    # Also pins MKL's GEMM code path, so the same command gives the same bits
    # every time (dtbook/reproducibility.py): kill-and-resume ends torch.equal.
    # On GPUs: device is cuda:LOCAL_RANK, and choose_backend has already called
    # torch.cuda.set_device(device), before init_process_group.
    backend, device = choose_backend(args.backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.global_batch_size:
        args.accum_steps = accumulation_for(args.global_batch_size, world_size,
                                            args.batch_size)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.corpus_tokens, cfg.vocab_size, cfg.context,
                             args.seed)
    check_training_inputs(args, world_size, len(dataset))
    global_batch = world_size * args.batch_size * args.accum_steps
    steps_per_epoch = len(dataset) // global_batch
    total_steps = args.max_steps or args.epochs * steps_per_epoch

    # env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    dist.init_process_group(backend=backend, init_method="env://",
                            device_id=process_group_device(device))
    metrics = open_metrics(args.metrics, backend, device)
    model, optimizer, scaler = build_model(args, device, rank)
    loader = rank_loader(dataset, args.batch_size, rank, world_size, args.seed)

    meta = {"model": args.model, "seed": args.seed,
            "corpus_tokens": args.corpus_tokens, "amp": args.amp,
            "global_batch": global_batch, "world_size": world_size}
    step, start_epoch, start_step_in_epoch = 0, 0, 0
    if args.resume:
        step, start_epoch, start_step_in_epoch = resume(
            args, model, optimizer, scaler, meta, device, metrics)

    n_params = sum(p.numel() for p in model.parameters())
    settings = {k: str(v) if isinstance(v, Path) else v
                for k, v in vars(args).items()}
    metrics.write(event="config", **settings, params=n_params,
                  global_batch=global_batch, steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps)
    if rank == 0:
        print(f"GPT-{args.model} ({n_params:,} parameters) on {world_size} "
              f"process(es), {backend}/{device.type}; global batch {world_size} x "
              f"{args.batch_size} x {args.accum_steps} = {global_batch}; "
              f"{steps_per_epoch} steps/epoch, training to step {total_steps}",
              flush=True)

    # From here on a scheduler's signal means "finish this step, save, exit".
    stop_request = StopRequest() if args.checkpoint_dir else None
    metrics.write(event="started", step=step, unix_time=time.time(),
                  restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    progress = Progress(args.log_every, total_steps, global_batch, metrics,
                        args.print_every)
    model.train()
    for epoch in range(start_epoch, math.ceil(total_steps / steps_per_epoch)):
        # Without set_epoch every epoch would replay the same shuffle.
        loader.sampler.set_epoch(epoch)
        skip = start_step_in_epoch if epoch == start_epoch else 0
        # A resumed run skips the micro-batches the checkpointed run already trained
        # on in this epoch.
        micro_batches = itertools.islice(iter(loader), skip * args.accum_steps, None)
        for step_in_epoch in range(skip, steps_per_epoch):
            if step >= total_steps:
                break
            step_loss = train_step(model, optimizer, scaler, micro_batches, args,
                                   device)
            step += 1
            if args.amp == "fp16":
                progress.step_done(step, epoch, step_loss,
                                   grad_scale=scaler.get_scale())
            else:
                progress.step_done(step, epoch, step_loss)
            if args.checkpoint_dir and (step % args.save_every == 0
                                        or step == total_steps):
                saved_at = time.perf_counter()
                state = training_state(model, optimizer, scaler, step, epoch,
                                       step_in_epoch + 1, meta)
                path = save_checkpoint(args.checkpoint_dir, args.keep, state, device)
                seconds = progress.exclude_since(saved_at)
                metrics.write(event="checkpoint", step=step, path=str(path),
                              seconds=seconds,
                              bytes=path.stat().st_size if rank == 0 else None)
            stoppable = stop_request is not None and step < total_steps
            signum = stop_request.agreed(device) if stoppable else 0
            if signum:
                state = training_state(model, optimizer, scaler, step, epoch,
                                       step_in_epoch + 1, meta)
                stop_with_checkpoint(signum, args, state, device, metrics)
            # The fault strikes once: workers that torchrun restarted run on.
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if (step, rank, restarts) == (args.crash_at_step, args.crash_rank, 0):
                # One write, so the message stays one line among the other ranks'.
                sys.stderr.write(f"[rank {rank}] fault injection: SIGKILL after "
                                 f"step {step}\n")
                metrics.write(event="fault_injected", step=step,
                              unix_time=time.time())
                os.kill(os.getpid(), signal.SIGKILL)

    summarize(args, model, metrics, step, progress)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
