"""Train the book's GPT with PyTorch Lightning: chapter 3's program, with the Trainer's loop.

    torchrun --standalone --nproc_per_node=2 scripts/ch6_lightning.py             # two processes
    torchrun --standalone --nproc_per_node=2 scripts/ch6_lightning.py --accum-steps 2 --amp bf16
    torchrun --standalone --nproc_per_node=2 scripts/ch6_lightning.py --val-windows 11
    torchrun --standalone --nproc_per_node=2 scripts/ch6_lightning.py --strategy model-parallel
    torchrun --standalone --nproc_per_node=2 scripts/ch6_lightning.py --checkpoint-dir runs/l --resume
    python scripts/ch6_lightning.py                                              # a world of one
    sbatch scripts/slurm/ch6_lightning.sbatch     # Slurm: one srun task per device, no torchrun

The model (dtbook.model.GPT), the corpus (dtbook.data) and the optimizer are chapter 3's, and so
are the flags that mean the same thing. What changes is who writes the loop: a LightningModule
says what one step computes, and Trainer(strategy="ddp") creates the process group, wraps the
model in DistributedDataParallel, replaces the loader's sampler with a DistributedSampler and
calls its set_epoch, seeds every process, accumulates gradients (--accum-steps), clips them
(--grad-clip), autocasts (--amp), and writes and restores checkpoints (ModelCheckpoint,
ckpt_path="last"). The run records what Lightning set up, so the book can show it.

--strategy ddp             DDPStrategy with chapter 3's knobs (--bucket-cap-mb, --static-graph,
                           --find-unused-parameters, --comm-hook)
--strategy model-parallel  ModelParallelStrategy: configure_model() applies FSDP2's fully_shard
--strategy fsdp            FSDPStrategy (FSDP1); Lightning accepts it only on GPUs
--sampler lightning        the DistributedSampler Lightning injects (the default)
--sampler book             chapter 3's own rank_loader; Lightning is told to leave it alone
--sampler resumable        the same, plus state_dict/load_state_dict: Lightning checkpoints
                           the position inside the epoch and resumes from it
--val-windows N            validate once, after the last step, on N held-out windows: with
                           --sampler lightning through the padded DistributedSampler that
                           Lightning injects, else rank r takes windows r, r + W, ... once each;
                           rank 0 also evaluates the whole set alone, the exact reference
--amp fp16                 precision="16-mixed": on a CPU Lightning runs bf16-mixed instead

Under torchrun Lightning joins the process group torchrun describes; under srun (one task per
device) it reads Slurm's variables through SLURMEnvironment, and on SIGUSR1 it saves
hpc_ckpt_N.ckpt in --checkpoint-dir and requeues the job, which then resumes from that file;
with plain python it is a world of one. --crash-at-step N SIGKILLs one process after optimizer
step N, once (as in chapter 3).
"""

import argparse
import dataclasses
import itertools
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from dtbook.reproducibility import require_reproducible_cpu_math

# Before the first matrix product (see dtbook.reproducibility): Lightning's import multiplies none.
require_reproducible_cpu_math()

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dtbook.checkpoint import atomic_save, state_dict_fingerprint  # noqa: E402
from dtbook.cli import (  # noqa: E402
    ScriptError,
    add_backend_and_metrics,
    check_training_inputs,
    one_line,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import (  # noqa: E402
    DEFAULTS,
    TokenWindows,
    corpus_windows,
    rank_loader,
    synthetic_corpus,
)
from dtbook.distributed import choose_backend, open_metrics  # noqa: E402
from dtbook.model import GPT, MODEL_SIZES  # noqa: E402

PRECISION = {"off": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
COMM_HOOKS = {"none": None, "fp16": default_hooks.fp16_compress_hook,
              "bf16": default_hooks.bf16_compress_hook}


def quiet_library_notices() -> None:
    """Drop Lightning's notices that say nothing about this program.

    Two deprecation warnings raised inside Lightning 2.6.6's own code (its pytree
    helper and its all_gather), the advertisement for its cloud logger, the hint to
    use srun on a machine that has Slurm installed, the report of no TPU, and the notice
    that a run without --val-windows skips validation_step. Everything else Lightning
    says, warnings about the reader's code included, is kept.
    """
    for message in [r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                    r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                    r"The `srun` command is available on your system but is not used",
                    r"You defined a `validation_step` but have no `val_dataloader`"]:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith(("💡 Tip:", "TPU available: False")))


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
        help="micro-steps per optimizer step: Trainer(accumulate_grad_batches=...) (default: 1)")
    add("--lr", type=positive_float, default=DEFAULTS.lr, help="AdamW learning rate (default: 0.01)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus, the initial weights and the shuffle")
    add("--amp", choices=sorted(PRECISION), default="off",
        help="Trainer precision: off = 32-true, bf16 = bf16-mixed, fp16 = 16-mixed (default: off)")
    add("--grad-clip", type=positive_float, help="clip the gradients' total 2-norm to this value")
    add("--strategy", choices=["ddp", "model-parallel", "fsdp"], default="ddp",
        help="how Lightning distributes the model (default: ddp)")
    add("--sampler", choices=["lightning", "book", "resumable"], default="lightning",
        help="who builds the DistributedSampler (default: lightning)")
    add("--bucket-cap-mb", type=positive_float, default=DEFAULTS.bucket_cap_mb,
        help="DDP gradient bucket size in MiB (default: 25, DDP's own default)")
    add("--static-graph", action="store_true", help="DDP(static_graph=True)")
    add("--find-unused-parameters", action="store_true", help="DDP(find_unused_parameters=True)")
    add("--comm-hook", choices=sorted(COMM_HOOKS), default="none",
        help="DDP communication hook: compress gradients to fp16 or bf16 (default: none)")
    add("--checkpoint-dir", type=Path, help="where ModelCheckpoint writes (rank 0)")
    add("--save-every", type=positive_int, default=50,
        help="checkpoint every N optimizer steps, and last.ckpt with it (default: 50)")
    add("--resume", action="store_true", help='continue from --checkpoint-dir/last.ckpt (ckpt_path="last")')
    add("--val-windows", type=positive_int,
        help="validate once after the last step on this many held-out windows (default: none)")
    add("--log-every", type=positive_int, default=10, help="log the loss every N steps")
    add("--print-every", type=positive_int,
        help="print progress on the console every N steps (default: every logged step)")
    add("--save-final", type=Path, help="rank 0 writes the final model state dict here")
    add("--crash-at-step", type=positive_int,
        help="fault injection: SIGKILL one process right after this optimizer step")
    add("--crash-rank", type=int, help="the process --crash-at-step kills (default: the last rank)")
    add("--wait-for-signal-after-step", type=positive_int, metavar="N",
        help="preemption demo: after step N every process waits (up to 120 s) for the job to be "
             "signalled, so that the signal finds them all between steps; first run of a job only")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    args.print_every = args.print_every or args.log_every
    ddp_only = [flag for flag, on in [("--static-graph", args.static_graph),
                                      ("--find-unused-parameters", args.find_unused_parameters),
                                      ("--comm-hook", args.comm_hook != "none"),
                                      # A sharded forward gathers: unequal shards would hang.
                                      ("--val-windows", args.val_windows)] if on]
    if ddp_only and args.strategy != "ddp":
        parser.error(f"{', '.join(ddp_only)} only apply to --strategy ddp")
    return args


# --------------------------------------------------------------------------
# What one step computes: the LightningModule
# --------------------------------------------------------------------------


def shard_with_fsdp2(model: GPT, mesh) -> None:
    """FSDP2 as ch4_fsdp.py applies it: each block, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # The root's parameters are needed again at once by backward: keep them gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


class LitGPT(L.LightningModule):
    """The book's GPT and AdamW; Lightning decides where, how often and on which batches."""

    def __init__(self, args, model: GPT, metrics_opener):
        super().__init__()
        self.args, self.model, self.open_metrics = args, model, metrics_opener
        self.metrics = None
        self.micro_losses: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.steps_this_run = self.steps_since_log = 0

    def configure_model(self) -> None:
        # ModelParallelStrategy hands over a device mesh; DDP does not call for sharding.
        if self.args.strategy == "model-parallel":
            shard_with_fsdp2(self.model, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.args.lr)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0 and self.current_epoch == 0:
            self.record_compute_dtype()
        loss = self.model(x, y)
        self.micro_losses.append(loss.detach())
        # Which windows this step trained on, as one number: shows a replayed batch in the log.
        self.last_batch_sum = int(x.sum())
        return loss

    def record_compute_dtype(self) -> None:
        # Inside training_step the precision plugin's autocast is on: a matrix product
        # shows the dtype the model computes in, whatever precision was asked for.
        probe = torch.ones(2, 2, device=self.device)
        self.metrics.write(event="compute_dtype", matmul=str((probe @ probe).dtype),
                           autocast=torch.is_autocast_enabled(self.device.type))

    # ----------------------------------------------------------------------
    # Validation: the mean Lightning logs, and the sums that count each window once
    # ----------------------------------------------------------------------

    def window_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)

    def validation_step(self, batch, batch_idx):
        per_window = self.window_losses(*batch)
        # What a Lightning program usually logs: the batch mean, then the mean over ranks.
        self.log("val_loss", per_window.mean(), sync_dist=True)
        # Sums over batches and ranks: every window evaluated counts once, repeats too.
        self.log("val_loss_sum", per_window.sum(), sync_dist=True, reduce_fx="sum")
        self.log("val_windows", float(len(per_window)), sync_dist=True, reduce_fx="sum")

    def on_validation_start(self) -> None:
        # The dataset indices this rank's validation loader will visit, gathered on every rank.
        self.val_indices = [None] * dist.get_world_size()
        dist.all_gather_object(self.val_indices,
                               [int(i) for i in self.trainer.val_dataloaders.sampler])

    def on_validation_end(self) -> None:
        logged = {k: v.item() for k, v in self.trainer.callback_metrics.items()
                  if k.startswith("val_")}
        alone = None
        if self.global_rank == 0:  # the reference: the whole set, each window once
            val = self.trainer.val_dataloaders.dataset
            windows = [val[i] for i in range(len(val))]
            x, y = (torch.stack(t).to(self.device) for t in zip(*windows, strict=True))
            with torch.no_grad(), self.trainer.precision_plugin.forward_context():
                alone = self.window_losses(x, y).mean().item()
        self.metrics.write(event="validation", step=self.trainer.global_step,
                           sampler=type(self.trainer.val_dataloaders.sampler).__name__,
                           rank_indices=self.val_indices, one_process_loss=alone, **logged)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # Record the norm Lightning clips, before and after, on logged steps.
        logged = (self.trainer.global_step + 1) % self.args.log_every == 0
        before = self.grad_norm() if logged and gradient_clip_val else None
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if before is not None:
            self.metrics.write(event="clip", step=self.trainer.global_step + 1,
                               norm_before=before, norm_after=self.grad_norm(),
                               max_norm=gradient_clip_val)

    def grad_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g)
             for g in grads])).item()

    # ----------------------------------------------------------------------
    # Hooks that show what the Trainer set up (recorded from the run itself)
    # ----------------------------------------------------------------------

    def on_fit_start(self) -> None:
        self.metrics = self.open_metrics()
        # One line on the console, not one per process: Lightning knows which rank is zero.
        rank_zero_info(f"rank_zero_info: printed once by rank {self.global_rank} of "
                       f"{self.trainer.world_size}")
        self.start = self.last_log = time.perf_counter()

    def on_train_start(self) -> None:
        # The loader exists from here on: Lightning has replaced its sampler by now.
        trainer = self.trainer
        sampler = trainer.train_dataloader.sampler
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16 on a GPU only
        self.metrics.write(
            event="lightning_setup",
            strategy=type(trainer.strategy).__name__,
            cluster_environment=type(trainer.strategy.cluster_environment).__name__,
            process_group_backend=dist.get_backend(),
            world_size=dist.get_world_size(),
            wrapped_model=type(trainer.strategy.model).__name__,
            precision=trainer.precision,
            precision_plugin=type(trainer.precision_plugin).__name__,
            grad_scaler=type(scaler).__name__ if scaler else None,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            pl_global_seed=os.environ.get("PL_GLOBAL_SEED"),
            sampler=type(sampler).__name__,
            sampler_settings={k: getattr(sampler, k, None) for k in
                              ("num_replicas", "rank", "shuffle", "seed", "drop_last",
                               "num_samples", "total_size")},
            ddp_kwargs={k: str(v) for k, v in getattr(trainer.strategy, "_ddp_kwargs", {}).items()},
            params=sum(p.numel() for p in self.model.parameters()),
        )
        if hasattr(self, "resumed_from"):
            self.metrics.write(event="resume", **self.resumed_from,
                               step_after_restore=trainer.global_step,
                               epoch_after_restore=self.current_epoch)

    def on_train_epoch_start(self) -> None:
        sampler = self.trainer.train_dataloader.sampler
        first = [int(i) for _, i in zip(range(4), iter(sampler), strict=False)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"rank": self.global_rank, "first_indices": first,
                                          "sampler_epoch": getattr(sampler, "epoch", None)})
        self.metrics.write(event="epoch_start", epoch=self.current_epoch, ranks=everyone)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if len(self.micro_losses) < self.trainer.accumulate_grad_batches and not self.trainer.is_last_batch:
            return
        step = self.trainer.global_step  # optimizer steps taken so far, this one included
        step_loss = torch.stack(self.micro_losses).mean()
        self.micro_losses.clear()
        self.steps_this_run += 1
        self.steps_since_log += 1
        total = self.trainer.max_steps
        if step % self.args.log_every == 0 or step == total:
            # sync_dist=True: Lightning all-reduces the value to the mean over the ranks.
            self.log("loss", step_loss, sync_dist=True)
            synced = self.trainer.callback_metrics["loss"].item()
            per_rank = self.all_gather(step_loss).tolist()
            self.losses.append(synced)
            now = time.perf_counter()
            step_time = (now - self.last_log) / self.steps_since_log
            self.metrics.write(event="step", step=step, epoch=self.current_epoch, loss=synced,
                               rank_losses=per_rank, batch_token_sum=self.last_batch_sum,
                               step_time_s=step_time,
                               samples_per_s=self.global_batch() / step_time)
            if step % self.args.print_every == 0 or step == total:
                rank_zero_info(f"step {step:>5}/{total} | epoch {self.current_epoch} | "
                               f"loss {synced:.4f} | "
                               f"{self.global_batch() / step_time:,.0f} samples/s")
            self.last_log, self.steps_since_log = now, 0
        self.maybe_crash(step)
        self.maybe_wait_for_signal(step)

    def global_batch(self) -> int:
        return self.trainer.world_size * self.args.batch_size * self.args.accum_steps

    def maybe_crash(self, step: int) -> None:
        # The fault strikes once: workers that torchrun restarted run on.
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if (step, self.global_rank, restarts) == (self.args.crash_at_step, self.args.crash_rank, 0):
            sys.stderr.write(f"[rank {self.global_rank}] fault injection: SIGKILL after step {step}\n")
            self.metrics.write(event="fault_injected", step=step, unix_time=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_wait_for_signal(self, step: int) -> None:
        # Lightning's SIGUSR1 handler saves a checkpoint, a collective: a rank caught inside
        # backward's all-reduce while another runs the handler would deadlock both (see 6.5).
        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if step != self.args.wait_for_signal_after_step or not first_run:
            return
        self.metrics.write(event="waiting_for_signal", step=step, unix_time=time.time())
        rank_zero_info(f"after step {step}: waiting for the job to be signalled")
        deadline = time.monotonic() + 120
        while not self.trainer.received_sigterm:  # SIGTERM follows the requeue
            if time.monotonic() > deadline:
                raise ScriptError(f"--wait-for-signal-after-step {step}: no signal came in 120 s")
            time.sleep(0.05)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.metrics.write(event="checkpoint", step=checkpoint["global_step"],
                           epoch=checkpoint["epoch"], keys=sorted(checkpoint))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.resumed_from = {"step": checkpoint["global_step"], "epoch": checkpoint["epoch"],
                             "keys": sorted(checkpoint),
                             "file": Path(self.trainer.ckpt_path or "").name}

    def on_fit_end(self) -> None:
        seconds = time.perf_counter() - self.start
        steps = self.steps_this_run
        self.metrics.write(event="summary", steps=self.trainer.global_step, steps_this_run=steps,
                           first_loss=self.losses[0] if self.losses else None,
                           final_loss=self.losses[-1] if self.losses else None, train_s=seconds,
                           samples_per_s=steps * self.global_batch() / seconds if steps else None)


# --------------------------------------------------------------------------
# Building the run
# --------------------------------------------------------------------------


def started_by_srun() -> bool:
    """Slurm started this process itself (srun, one task per device), not torchrun."""
    return "LOCAL_WORLD_SIZE" not in os.environ and SLURMEnvironment.detect()


def world_from_launcher() -> tuple[int, int]:
    """(processes per node, nodes): from torchrun, from Slurm, or a world of one."""
    if started_by_srun():
        nodes = int(os.environ["SLURM_NNODES"])
        return int(os.environ["SLURM_NTASKS"]) // nodes, nodes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return local, int(os.environ.get("WORLD_SIZE", 1)) // local


def process_rank() -> int:
    if started_by_srun():
        return int(os.environ["SLURM_PROCID"])
    return int(os.environ.get("RANK", 0))


def make_strategy(args, backend: str, world_size: int):
    """Chapter 3's DDP knobs, spelled as Lightning's strategy arguments."""
    if args.strategy == "model-parallel":
        # "auto" would count GPUs per node; on CPUs the mesh is given: all data parallel.
        return ModelParallelStrategy(data_parallel_size=world_size,
                                     tensor_parallel_size=1)
    if args.strategy == "fsdp":
        return FSDPStrategy(process_group_backend=backend)
    return DDPStrategy(process_group_backend=backend,
                       bucket_cap_mb=args.bucket_cap_mb,
                       static_graph=args.static_graph,
                       find_unused_parameters=args.find_unused_parameters,
                       ddp_comm_hook=COMM_HOOKS[args.comm_hook])


def checkpointing(args) -> list[ModelCheckpoint]:
    """Rank 0 writes step<N>.ckpt every --save-every steps, and last.ckpt."""
    if not args.checkpoint_dir:
        return []
    # ckpt_path="last" looks for last.ckpt in this callback's directory.
    return [ModelCheckpoint(dirpath=args.checkpoint_dir, filename="step{step:08d}",
                            auto_insert_metric_name=False, save_last=True,
                            every_n_train_steps=args.save_every, save_top_k=1)]


def slurm_plugins() -> list:
    """Under srun, Lightning's default spelled out, so the knob is visible.

    SIGUSR1 (Slurm's warning before a time limit or preemption): save
    hpc_ckpt_N.ckpt in the Trainer's default_root_dir, then requeue the job.
    """
    if not started_by_srun():
        return []
    return [SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)]


def make_trainer(args, backend: str, devices: int, num_nodes: int,
                 total_steps: int) -> L.Trainer:
    callbacks = checkpointing(args)
    # Validate once, after the last micro-batch of all epochs; no sanity pass.
    validation = dict(check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      val_check_interval=total_steps * args.accum_steps)
    try:
        return L.Trainer(
            accelerator="cuda" if backend == "nccl" else "cpu",
            devices=devices, num_nodes=num_nodes,
            strategy=make_strategy(args, backend, devices * num_nodes),
            precision=PRECISION[args.amp],
            max_steps=total_steps, max_epochs=-1,
            accumulate_grad_batches=args.accum_steps,
            gradient_clip_val=args.grad_clip,
            use_distributed_sampler=args.sampler == "lightning",
            callbacks=callbacks, enable_checkpointing=bool(callbacks),
            plugins=slurm_plugins(), **validation,
            default_root_dir=args.checkpoint_dir,  # hpc_ckpt_N.ckpt: saved, found
            logger=False, enable_progress_bar=False, enable_model_summary=False)
    except Exception as err:  # Lightning refuses what this device cannot do
        raise ScriptError(f"Lightning refuses --strategy {args.strategy} --amp "
                          f"{args.amp} on {backend}: {one_line(err)}") from None


class ResumableLoader:
    """A loader that knows where it is in the epoch, so a checkpoint can hold that.

    Lightning saves the state_dict() of every training loader that has one in the
    checkpoint and hands it back to load_state_dict() before resuming; a plain
    DataLoader has none, and a run resumed mid-epoch starts the epoch's data over.
    """

    def __init__(self, loader: DataLoader):
        # Lightning finds the sampler here to call its set_epoch.
        self.loader, self.sampler = loader, loader.sampler
        self.batches_fetched = self.skip = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.batches_fetched, self.skip = self.skip, 0
        for batch in itertools.islice(self.loader, self.batches_fetched, None):
            self.batches_fetched += 1
            yield batch

    def state_dict(self) -> dict:
        return {"batches_fetched": self.batches_fetched}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["batches_fetched"]


def make_loader(args, dataset, world_size: int):
    if args.sampler != "lightning":
        loader = rank_loader(dataset, args.batch_size, process_rank(), world_size, args.seed)
        return ResumableLoader(loader) if args.sampler == "resumable" else loader
    # What a single-device program writes; Lightning swaps the sampler for a distributed one.
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)


def validation_loader(args, cfg, rank: int, world_size: int) -> DataLoader | None:
    """--val-windows windows held out after the training corpus, from the same chain."""
    if not args.val_windows:
        return None
    tokens = synthetic_corpus(args.corpus_tokens + args.val_windows * cfg.context,
                              cfg.vocab_size, args.seed)
    val = TokenWindows(tokens[args.corpus_tokens - 1:], cfg.context)
    if args.sampler == "lightning":  # a one-device loader: Lightning injects the sampler
        return DataLoader(val, batch_size=args.batch_size)
    # Every window once, on one rank: the shards may differ in length by one window.
    return DataLoader(val, batch_size=args.batch_size,
                      sampler=range(rank, len(val), world_size))


def save_final(args, lit: LitGPT, metrics) -> None:
    """Collective for a sharded model: gather the full weights, fingerprint, rank 0 writes."""
    full = get_model_state_dict(lit.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    fingerprint = state_dict_fingerprint(full) if dist.get_rank() == 0 else {}
    if args.save_final and dist.get_rank() == 0:
        args.save_final.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(full, args.save_final)
    metrics.write(event="weights", **fingerprint)
    if dist.get_rank() == 0:
        print(f"done: step {lit.trainer.global_step}, weights sha256 "
              f"{fingerprint['weights_sha256'][:12]}", flush=True)


def main() -> None:
    args = parse_args()
    quiet_library_notices()
    backend, device = choose_backend(args.backend)
    devices, num_nodes = world_from_launcher()
    world_size = devices * num_nodes
    cfg = dataclasses.replace(MODEL_SIZES[args.model], dropout=args.dropout)
    dataset = corpus_windows(args.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    check_training_inputs(args, world_size, len(dataset))
    steps_per_epoch = len(dataset) // (world_size * args.batch_size * args.accum_steps)
    total_steps = args.max_steps or args.epochs * steps_per_epoch

    # Seeds torch, numpy and random on this process and exports PL_GLOBAL_SEED, which the
    # injected DistributedSampler uses as its shuffle seed; the initial weights are drawn next,
    # from the same seed as ch3_train.py draws them.
    L.seed_everything(args.seed, verbose=False)
    model = GPT(cfg)
    lit = LitGPT(args, model, lambda: open_metrics(args.metrics, backend, device))
    group_before = dist.is_available() and dist.is_initialized()
    trainer = make_trainer(args, backend, devices, num_nodes, total_steps)
    ckpt_path = "last" if args.resume else None
    if args.resume and not (args.checkpoint_dir / "last.ckpt").exists():
        rank_zero_info(f"--resume: no last.ckpt in {args.checkpoint_dir} yet, starting from step 0")
        ckpt_path = None
    trainer.fit(lit, train_dataloaders=make_loader(args, dataset, world_size),
                val_dataloaders=validation_loader(args, cfg, process_rank(), world_size),
                ckpt_path=ckpt_path)
    lit.metrics.write(event="process_group", created_before_trainer=group_before,
                      initialized_after_fit=dist.is_initialized())
    save_final(args, lit, lit.metrics)
    lit.metrics.close()


if __name__ == "__main__":
    run_main(main)
