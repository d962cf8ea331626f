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
itself right after optimizer step N.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common import (
    GPT,
    MODEL_SIZES,
    MetricsWriter,
    ScriptError,
    TokenWindows,
    choose_backend,
    positive_float,
    positive_int,
    provenance,
    run_main,
    synthetic_corpus,
    use_single_process_defaults,
)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout probability; 0 (default) keeps runs comparable across world sizes")
    parser.add_argument("--corpus-tokens", type=positive_int, default=160_000,
                        help="length of the synthetic corpus (default: 160000 tokens = 2499 windows)")
    parser.add_argument("--epochs", type=positive_int, default=3, help="passes over the corpus (default: 3)")
    parser.add_argument("--max-steps", type=positive_int,
                        help="stop after this many optimizer steps; overrides --epochs")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="windows per process per micro-step")
    parser.add_argument("--accum-steps", type=positive_int, default=1,
                        help="micro-steps per optimizer step; only the last one all-reduces (default: 1)")
    parser.add_argument("--lr", type=positive_float, default=1e-2, help="AdamW learning rate (default: 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the corpus, the initial weights and the shuffle")
    parser.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                        help="autocast dtype; fp16 adds a GradScaler (default: off)")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                        help="DDP gradient bucket size in MiB (default: 25, DDP's own default)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="process-group backend (default: nccl if every local rank has a GPU, else gloo)")
    parser.add_argument("--checkpoint-dir", type=Path, help="where rank 0 writes checkpoints")
    parser.add_argument("--save-every", type=positive_int, default=50,
                        help="checkpoint every N optimizer steps, and at the end (default: 50)")
    parser.add_argument("--keep", type=positive_int, default=2, help="how many newest checkpoints to keep")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest readable checkpoint in --checkpoint-dir")
    parser.add_argument("--log-every", type=positive_int, default=10, help="log the loss every N steps")
    parser.add_argument("--metrics", help="rank 0 appends JSON lines here")
    parser.add_argument("--save-final", type=Path, help="rank 0 writes the final model state dict here")
    parser.add_argument("--crash-at-step", type=positive_int,
                        help="fault injection: SIGKILL one process right after this optimizer step")
    parser.add_argument("--crash-rank", type=int,
                        help="the process --crash-at-step kills (default: the last rank)")
    args = parser.parse_args()
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


# --------------------------------------------------------------------------
# Checkpoints: rank 0 writes atomically, every rank reads the same file
# --------------------------------------------------------------------------


def checkpoint_paths(ckpt_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary files of an interrupted write never match)."""
    return sorted(ckpt_dir.glob("ckpt_step*.pt"))


def atomic_save(obj, path: Path) -> None:
    """Write to a temporary file in the same directory, make it durable, then rename it into place.

    A crash at any moment leaves either the old state or the complete new file under ``path``,
    never a half-written one: rename within a directory is atomic, and the fsyncs make sure the
    bytes (and then the directory entry) reach the disk before we rely on them.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def capture_rng_state(device: torch.device) -> dict:
    """This process's random number generators, as tensors and tuples that torch.load(weights_only=True) accepts."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save_checkpoint(ckpt_dir: Path, keep: int, state: dict, device: torch.device) -> Path:
    """Collective: every rank sends its RNG state to rank 0, rank 0 writes and rotates, all wait."""
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
    # Nobody runs ahead until the checkpoint exists: a failure from here on can resume from it.
    dist.barrier()
    return path


def summarize(err: Exception) -> str:
    """An exception as one short line: torch.load's messages run to several paragraphs."""
    text = str(err).strip()
    first_sentence = text.splitlines()[0].split(". ")[0][:160] if text else "no detail"
    return f"{type(err).__name__}: {first_sentence}"


def find_resume_checkpoint(ckpt_dir: Path, device: torch.device) -> tuple[Path | None, str | None]:
    """Rank 0 only: the newest checkpoint that loads, else (None, why not).

    An unreadable file (truncated by a full disk, corrupted by a copy) is reported and skipped.
    """
    candidates = checkpoint_paths(ckpt_dir)
    if not candidates:
        return None, None
    for path in reversed(candidates):
        try:
            ckpt = torch.load(path, map_location=device, weights_only=True)
            missing = {"model", "optimizer", "scaler", "step", "epoch", "step_in_epoch", "rng", "meta"} - set(ckpt)
            if missing:
                raise ValueError(f"missing {sorted(missing)}")
            return path, None
        except Exception as err:  # any reason a file cannot be used is a reason to try the previous one
            print(f"warning: skipping unreadable checkpoint {path}: {summarize(err)}", file=sys.stderr, flush=True)
    return None, f"none of the {len(candidates)} checkpoint(s) in {ckpt_dir} can be read"


def load_checkpoint(ckpt_dir: Path, device: torch.device) -> dict | None:
    """Collective: rank 0 picks the file, every rank loads that same file onto its own device."""
    choice = [None, None]
    if dist.get_rank() == 0:
        path, problem = find_resume_checkpoint(ckpt_dir, device)
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
        raise ScriptError(f"cannot read checkpoint {path} (is it on storage every node sees?): "
                          f"{summarize(err)}") from None
    ckpt["path"] = path
    return ckpt


def weights_fingerprint(model: torch.nn.Module) -> dict:
    """Numbers that identify a set of weights: equal weights give equal fingerprints on any world size."""
    digest = hashlib.sha256()
    abs_sum = 0.0
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
        abs_sum += tensor.double().abs().sum().item()
    return {"weights_sha256": digest.hexdigest(), "weights_abs_sum": abs_sum}


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    use_single_process_defaults()
    backend, device = choose_backend(args.backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    # Check everything we can before joining the process group, so bad input fails fast on every rank.
    cfg = dataclasses.replace(MODEL_SIZES[args.model], dropout=args.dropout)
    dataset = TokenWindows(synthetic_corpus(args.corpus_tokens, cfg.vocab_size, args.seed), cfg.context)
    global_batch = world_size * args.batch_size * args.accum_steps
    steps_per_epoch = len(dataset) // global_batch
    if steps_per_epoch == 0:
        raise ScriptError(
            f"one optimizer step needs {world_size} process(es) x --batch-size {args.batch_size} x "
            f"--accum-steps {args.accum_steps} = {global_batch} windows, but the corpus has only "
            f"{len(dataset)}: lower those or raise --corpus-tokens"
        )
    crash_rank = world_size - 1 if args.crash_rank is None else args.crash_rank
    if args.crash_at_step and not 0 <= crash_rank < world_size:
        raise ScriptError(f"--crash-rank {crash_rank} is not a rank of this world of {world_size}")
    if args.checkpoint_dir:
        try:
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.checkpoint_dir):
                pass
        except OSError as err:
            raise ScriptError(f"cannot write to --checkpoint-dir {args.checkpoint_dir}: {err}") from None
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)

    dist.init_process_group(backend=backend, init_method="env://")
    metrics = MetricsWriter(args.metrics, enabled=rank == 0)
    metrics.write(**provenance(backend, world_size, device))

    # The same seed on every rank gives the same initial weights (DDP broadcasts rank 0's anyway);
    # afterwards each rank gets its own stream, so dropout masks differ between replicas.
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # drop_last: every rank gets the same number of windows, none padded with repeats. The sampler
    # shuffles with seed + epoch, so all ranks agree on one permutation and take disjoint slices of it.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    # Its own generator: starting an epoch must not draw from the global RNG that checkpoints capture.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator())

    meta = {"model": args.model, "seed": args.seed, "corpus_tokens": args.corpus_tokens, "amp": args.amp,
            "global_batch": global_batch, "world_size": world_size}
    step, start_epoch, start_step_in_epoch = 0, 0, 0
    if args.resume:
        ckpt = load_checkpoint(args.checkpoint_dir, device)
        if ckpt is None:
            if rank == 0:
                print(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting from step 0", flush=True)
        else:
            changed = {k: (ckpt["meta"][k], meta[k]) for k in meta if k != "world_size" and ckpt["meta"][k] != meta[k]}
            if changed:
                raise ScriptError(f"checkpoint {ckpt['path']} belongs to a different run (checkpoint vs now: "
                                  + ", ".join(f"{k} {old} vs {new}" for k, (old, new) in changed.items()) + ")")
            model.module.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scaler.load_state_dict(ckpt["scaler"])
            step, start_epoch, start_step_in_epoch = ckpt["step"], ckpt["epoch"], ckpt["step_in_epoch"]
            if ckpt["meta"]["world_size"] == world_size:
                restore_rng_state(ckpt["rng"][rank], device)
            elif rank == 0:
                print(f"note: checkpoint written by {ckpt['meta']['world_size']} processes; the data order "
                      "continues exactly, the per-rank RNG streams do not", flush=True)
            metrics.write(event="resume", path=ckpt["path"], step=step, epoch=start_epoch)
            if rank == 0:
                print(f"resumed from {ckpt['path']} at step {step} (epoch {start_epoch})", flush=True)
            del ckpt

    n_params = sum(p.numel() for p in model.parameters())
    metrics.write(event="config", **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  params=n_params, global_batch=global_batch, steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps)
    if rank == 0:
        print(f"GPT-{args.model} ({n_params:,} parameters) on {world_size} process(es), {backend}/{device.type}; "
              f"global batch {world_size} x {args.batch_size} x {args.accum_steps} = {global_batch}; "
              f"{steps_per_epoch} steps/epoch, training to step {total_steps}", flush=True)

    autocast = torch.amp.autocast(device.type, dtype=AMP_DTYPES.get(args.amp), enabled=args.amp != "off")
    first_loss = last_loss = None
    train_start = last_log = time.perf_counter()
    steps_this_run = steps_since_log = 0
    model.train()
    for epoch in range(start_epoch, num_epochs):
        # Without set_epoch every epoch would replay the same shuffle.
        sampler.set_epoch(epoch)
        skip = start_step_in_epoch if epoch == start_epoch else 0
        # A resumed run skips the micro-batches the checkpointed run already trained on this epoch.
        micro_batches = itertools.islice(iter(loader), skip * args.accum_steps, None)
        for step_in_epoch in range(skip, steps_per_epoch):
            if step >= total_steps:
                break
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
            step += 1
            steps_this_run += 1
            steps_since_log += 1

            if step % args.log_every == 0 or step == total_steps:
                # Every rank saw a different slice of the batch: average the losses so any world size
                # reports the loss of the whole global batch.
                dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
                last_loss = step_loss.item() / world_size
                first_loss = last_loss if first_loss is None else first_loss
                now = time.perf_counter()
                step_time = (now - last_log) / steps_since_log
                record = {"step": step, "epoch": epoch, "loss": last_loss, "step_time_s": step_time,
                          "samples_per_s": global_batch / step_time}
                if args.amp == "fp16":
                    record["grad_scale"] = scaler.get_scale()
                metrics.write(event="step", **record)
                if rank == 0:
                    print(f"step {step:>5}/{total_steps} | epoch {epoch} | loss {last_loss:.4f} | "
                          f"{global_batch / step_time:,.0f} samples/s", flush=True)
                last_log, steps_since_log = time.perf_counter(), 0

            if args.checkpoint_dir and (step % args.save_every == 0 or step == total_steps):
                saved_at = time.perf_counter()
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "step": step, "epoch": epoch,
                         "step_in_epoch": step_in_epoch + 1, "meta": meta}
                path = save_checkpoint(args.checkpoint_dir, args.keep, state, device)
                metrics.write(event="checkpoint", step=step, path=str(path), bytes=path.stat().st_size if
                              rank == 0 else None, seconds=time.perf_counter() - saved_at)
                last_log += time.perf_counter() - saved_at  # keep checkpoint time out of samples/s

            if step == args.crash_at_step and rank == crash_rank:
                sys.stderr.write(f"[rank {rank}] fault injection: SIGKILL after step {step}\n")  # one write: one line
                os.kill(os.getpid(), signal.SIGKILL)

    train_seconds = time.perf_counter() - train_start
    fingerprint = weights_fingerprint(model.module)
    if args.save_final and rank == 0:
        args.save_final.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save_final)
    metrics.write(event="summary", steps=step, steps_this_run=steps_this_run, first_loss=first_loss,
                  final_loss=last_loss, train_s=train_seconds,
                  samples_per_s=steps_this_run * global_batch / train_seconds if steps_this_run else None,
                  **fingerprint)
    metrics.close()
    if rank == 0:
        print(f"done: step {step}, loss {last_loss if last_loss is None else round(last_loss, 4)}, "
              f"{train_seconds:.1f} s, weights sha256 {fingerprint['weights_sha256'][:12]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
