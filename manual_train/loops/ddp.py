# >>> DDP: the docstring shows torchrun's commands (one node, several nodes, restarts)
"""Distributed data parallel training under torchrun: one process per device, gradients all-reduced.

    torchrun --nproc_per_node=4 launch/ddp.py        # make demo: 4 CPU ranks (gloo), >= 0.95 val acc on digits
    python launch/ddp.py                             # the same script as a group of one
    torchrun --nproc_per_node=2 launch/ddp.py --batch-size 16 --epochs 2   # the weights of:
    python launch/single.py --batch-size 32 --epochs 2                      #   (global batch 32 in both)
    torchrun --nproc_per_node=8 launch/ddp.py --device cuda --batch-size 32    # one GPU per rank, nccl
    torchrun --standalone --nproc_per_node=4 --max-restarts 1 launch/ddp.py --out-dir runs/a --resume auto

Several nodes: the same torchrun on every node, meeting at one rendezvous endpoint and id. The c10d rendezvous
ignores --node-rank and numbers the nodes in the order they join, so global rank 0, which alone prints and
writes the outputs, may run on any of them: --out-dir must be on a filesystem every node shares.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id job42 \
             launch/ddp.py --device cuda --out-dir /shared/runs/job42        # the same on every node

Static rendezvous (--node-rank honoured) and Slurm: docs/ddp.md, "Single node, several nodes, Slurm".

`diff manual_train/loops/single.py manual_train/loops/ddp.py` is the lesson; every changed line is marked DDP:
  setup ............ rank and device from torchrun's environment, the device bound before init_process_group,
                     destroy_process_group in a finally
  the model ........ DistributedDataParallel: after each backward every rank holds the mean gradient, all-reduced
                     in buckets while backward is still running
  the sampler ...... each rank a disjoint 1/N of one permutation, set_epoch every epoch
  accumulation ..... no_sync() on all but a window's last micro-step: one all-reduce per optimizer step
  evaluation ....... disjoint shards, three sums all-reduced: exactly the single-process numbers
  decisions ........ early stopping and the NaN abort from all-reduced numbers: every rank takes the same branch
  side effects ..... rank 0 alone (master_process) prints, logs and saves checkpoints; a barrier after saving
Defaults (DEFAULTS below) differ from the baseline's in --batch-size only: 8 per rank, so 4 ranks train with
the baseline's global batch of 32 and its learning rate and schedule (docs/ddp.md, "The batch size, ...").
"""
# <<< DDP
from __future__ import annotations

import math
# >>> DDP: the process group, the wrapper and the --sync-bn conversion
from contextlib import nullcontext
from dataclasses import dataclass
# <<< DDP
import time

import torch
# >>> DDP
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
# <<< DDP

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train.checkpoint import capture_rng  # DDP: every rank's RNG streams go into the checkpoint
from manual_train.config import Config, UsageError, arg  # DDP: DDPConfig's flags and their checks
from manual_train.distributed import DistEnv, pick_device, read_env, setup, teardown  # DDP
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
# >>> DDP: pick_device (manual_train.distributed) chooses the device instead of resolve_device
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, seed_everything, set_deterministic
# <<< DDP

SCRIPT = "ddp"  # DDP


# >>> DDP: the flags this script adds to the baseline's, and its defaults
@dataclass
class DDPConfig(Config):
    """The baseline's flags plus the process group's (torchrun's own flags go before the script name)."""

    backend: str = arg("auto", "process-group backend: auto = nccl for CUDA devices, gloo for the CPU",
                       choices=("auto", "nccl", "gloo"))
    dist_timeout_s: float = arg(1800.0, "seconds a collective waits for the other ranks before it fails "
                                        "(torch's default is 30 min; at most 1e7 s, about 115 days)",
                                min=0, min_exclusive=True, max=1e7)
    sync_bn: bool = arg(False, "convert BatchNorm layers to SyncBatchNorm: statistics over the global batch "
                               "(CUDA only)")

    def validate(self) -> None:
        super().validate()
        env = read_env()
        on_cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        if self.backend == "nccl" and not on_cuda:
            raise UsageError("--backend", "nccl needs CUDA devices; this run uses the CPU", "auto, gloo")
        if self.sync_bn and not on_cuda:
            # torch: "SyncBatchNorm layers only work with GPU modules" (raised in forward, after set-up)
            raise UsageError("--sync-bn", "SyncBatchNorm runs on CUDA devices only; this run uses the CPU",
                             "--no-sync-bn, or --device cuda")
        if on_cuda and env.world_size > 1:
            # Checked here, identically on every local rank, rather than by the one rank that finds no GPU.
            if self.device.startswith("cuda:"):
                raise UsageError("--device", f"{self.device} names one GPU, but under torchrun each rank uses "
                                             "cuda:LOCAL_RANK", "auto, cuda, cpu")
            if env.local_world_size > torch.cuda.device_count():
                raise UsageError("--nproc_per_node", f"{env.local_world_size} ranks on this node but only "
                                                     f"{torch.cuda.device_count()} CUDA device(s)",
                                 f"at most {torch.cuda.device_count()}, or --device cpu")


# The baseline's per-process defaults train well at world size 1. Under DDP --batch-size is per rank, so the
# global batch grows with the ranks; 8 per rank gives the demo's 4 ranks the baseline's global batch of 32, and
# with it the baseline's learning rate and schedule unchanged: the same samples at every step as the baseline
# (0.9798 val acc after 10 epochs, as it; 4 x 32 at lr 0.05 reaches 0.8586, and 0.9731 with linear LR scaling).
DEFAULTS = dict(batch_size=8)
# <<< DDP


def train(cfg: Config) -> dict:
    # ------------------------------------------------------------------ setup
    # >>> DDP: who this process is (torchrun's environment) and its device; join the group, and leave it on every
    # exit path: destroy_process_group frees the communicators (NCCL warns at exit without it) and lets the same
    # process join another group later (the tests run several in one process)
    env = read_env()
    device = pick_device(cfg.device, env)  # cuda:LOCAL_RANK; setup() binds it before init_process_group
    setup(env, device, cfg.backend, cfg.dist_timeout_s)
    try:
        return train_rank(cfg, env, device)
    finally:
        teardown()


def train_rank(cfg: DDPConfig, env: DistEnv, device: torch.device) -> dict:
    # <<< DDP
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    train_ds, val_ds, info = data.build_datasets(cfg)
    # >>> DDP: rank r trains on perm[r::N] of the one permutation (n_train below is its share, padded with a few
    # repeats if N does not divide the set) and evaluates indices r, r+N, ... of the validation set (no repeats)
    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, env.world_size, env.rank), cfg, device,
                                   batch_size=cfg.eval_batch_size)
    # <<< DDP
    n_train = len(sampler)
    global_batch_size = cfg.batch_size * cfg.accumulate * env.world_size  # DDP: what one optimizer step averages
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)

    resume = cfg.resume_path()
    ckpt = load_checkpoint(resume) if resume else None
    if ckpt:
        check_compatible(ckpt, cfg, global_batch_size, total_steps)  # or exit: one line, nothing written

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model(cfg.model, info).to(param_dtype(cfg.precision))  # 64-true: fp32 init, upcast
    # >>> DDP: --sync-bn: BatchNorm statistics over the global batch, one extra all-reduce per BatchNorm layer
    # in every forward (CUDA only, refused on the CPU by DDPConfig.validate)
    if cfg.sync_bn:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    # <<< DDP
    if ckpt:
        raw_model.load_state_dict(ckpt["model"])  # fp32 (64-true: fp64) weights, before any O2 cast
    raw_model.to(device)  # moved once; nothing in the loop moves parameters again
    amp = Precision(cfg, device)
    model, params = amp.prepare(raw_model)  # 16-o2: fp16 model, fp32 master params for the optimizer
    optimizer = build_optimizer(cfg, params, lr)
    model, optimizer = amp.apex_initialize(model, optimizer)  # apex-o2 only
    # >>> DDP: wrap last, around what precision made of the model (16-o2's fp16 copy, apex's patched module).
    # The constructor broadcasts rank 0's parameters and buffers, so every rank starts from the same weights
    # whatever it built; it then hooks autograd so that backward all-reduces (averages) gradients in ~25 MB
    # buckets as soon as each bucket's gradients exist, overlapping communication with the rest of backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # <<< DDP
    params = [p for group in optimizer.param_groups for p in group["params"]]  # what clipping sees
    # >>> DDP: the weights are built and equal on every rank; from here each rank draws its own random numbers
    # (dropout masks, augmentations, DataLoader workers' seeds), not one stream N times over
    seed_everything(cfg.seed + env.rank)
    # <<< DDP
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    early = EarlyStopping(cfg.monitor, cfg.early_stop_patience, cfg.early_stop_min_delta)
    start_epoch, skip_micro_steps, step, samples_seen, best = resume_point(ckpt)
    if ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        amp.load_state_dict(ckpt["scaler"])
        early.load_state_dict(ckpt["early_stopping"])
        # >>> DDP: last: this rank's own streams, so every draw from here on repeats the uninterrupted run's
        # (a checkpoint of another world size holds rank 0's streams only: every rank takes those)
        per_rank = ckpt.get("rng_per_rank", [])
        restore_rng(per_rank[env.rank] if len(per_rank) == env.world_size else ckpt["rng"])
        # <<< DDP

    # >>> DDP: the default folder name holds a timestamp that ranks could read a second apart: rank 0 picks it,
    # the others take its choice (they need it for --restore-best and messages); rank 0 alone writes there
    out_dir_choice = [cfg.run_dir(SCRIPT) if env.master_process else None]
    dist.broadcast_object_list(out_dir_choice, src=0)
    out_dir = out_dir_choice[0]
    cfg.out_dir = str(out_dir)
    log = RunLog(out_dir, enabled=env.master_process, tensorboard=cfg.tensorboard,
                 resume_step=step if ckpt else None)
    # <<< DDP
    # >>> DDP: the banner's global batch is batch x accumulate x world size
    banner(log, script=SCRIPT, device=device, cfg=cfg, raw_model=raw_model, train_ds=train_ds, val_ds=val_ds,
           global_batch_size=global_batch_size, world_size=env.world_size, lr=lr, total_steps=total_steps,
           out_dir=out_dir,
           resumed_from=resume if ckpt else None, start_epoch=start_epoch, step=step)
    # <<< DDP

    # ------------------------------------------------------------------ training loop
    progress = progress_bar(total_steps, step, enabled=cfg.progress and env.master_process)  # DDP: rank 0's bar
    # Running sums stay on the device: adding loss.detach() costs no host sync and keeps no graph.
    loss_sum = torch.zeros((), device=device)
    correct_sum = torch.zeros((), device=device)
    log_steps = log_samples = log_targets = 0
    data_wait_s = 0.0
    t_start = t_log = time.perf_counter()
    samples_at_start = samples_seen
    val_loss = val_acc = math.nan
    epoch = start_epoch - 1  # epochs_run stays right when a finished run is resumed
    for epoch in range(start_epoch, num_epochs):
        sampler.set_epoch(epoch)  # a new permutation every epoch (else every epoch repeats the first)
        model.train()
        micro_steps_done = 0
        t_data = time.perf_counter()
        for micro_step, (x, y) in enumerate(train_loader):
            data_wait_s += time.perf_counter() - t_data  # time blocked on the loader
            if micro_step < skip_micro_steps:  # resuming mid-epoch: replay the sampler's order
                t_data = time.perf_counter()
                continue
            # non_blocking=True: from pinned memory the copy is asynchronous and overlaps compute.
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == len(train_loader)
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)

            # >>> DDP: inside no_sync() backward only adds into each rank's own .grad; the window's last micro-step
            # runs outside it and its backward all-reduces the accumulated sums. One all-reduce per optimizer step,
            # not per micro-batch, and the same mean gradient. (Forward is inside too: DDP prepares the reducer there.)
            with nullcontext() if window_end else model.no_sync():
                with amp.autocast():  # forward and loss only; a no-op context for 32-true and O2
                    logits = model(x)
                    loss = loss_fn(logits, y)
                amp.backward(loss * weight, optimizer, window_end)  # scaled backward under 16-mixed / O2
            # <<< DDP

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (summing `loss` itself would chain every step's graph).
            loss_sum += loss.detach() * weight
            correct_sum += correct_count(logits.detach(), y)
            log_samples += x.shape[0] * env.world_size  # DDP: every rank's micro-batch has this size (equal shards)
            log_targets += y.numel()
            samples_seen += x.shape[0] * env.world_size  # DDP: samples of all ranks
            micro_steps_done = micro_step + 1

            if window_end:
                amp.unscale_(optimizer)  # true gradients before clipping (16-o2: into the fp32 masters)
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if amp.step(optimizer):  # False when inf/NaN gradients made the scaler skip the step
                    scheduler.step()  # a skipped step does not advance the schedule (Lightning's does)
                step += 1
                log_steps += 1
                progress.update()
                last_window = micro_step + 1 == len(train_loader)
                if step % cfg.log_every == 0 or last_window or step == total_steps:
                    # >>> DDP: the log window's sums from every rank: the logged loss becomes the global mean, and a
                    # NaN on any rank reaches every rank, so they all raise below together (one rank raising alone
                    # would leave the others waiting in their next all-reduce). One small all-reduce per log row.
                    sums = torch.stack([loss_sum.double(), correct_sum.double(),
                                        torch.tensor(float(log_targets), dtype=torch.float64, device=device)])
                    dist.all_reduce(sums)
                    # .tolist() is a host sync: it waits for every queued kernel. Here once per log row.
                    loss_total, correct_total, targets_total = sums.tolist()
                    train_loss = loss_total / (log_steps * env.world_size)
                    train_acc = correct_total / targets_total
                    # <<< DDP
                    if not math.isfinite(train_loss):
                        raise TrainingDiverged.at(train_loss, step, log_steps, out_dir / "last.pt")
                    now = time.perf_counter()
                    log.row(step=step, epoch=epoch, split="train", loss=train_loss, acc=train_acc,
                            lr=scheduler.get_last_lr()[0], samples_per_s=log_samples / (now - t_log),
                            time_s=now - t_start)
                    progress.set_postfix(loss=f"{train_loss:.4f}", refresh=False)
                    loss_sum.zero_(), correct_sum.zero_()
                    log_steps = log_samples = log_targets = 0
                    t_log = now
                if step == total_steps:
                    break
            t_data = time.perf_counter()
        skip_micro_steps = 0
        epoch_done = micro_steps_done == len(train_loader)

        # -------------------------------------------------------------- evaluate, stop early, checkpoint
        improved = False
        last_epoch = epoch + 1 == num_epochs or step == total_steps
        if (epoch + 1) % cfg.eval_every == 0 or last_epoch:
            # >>> DDP: each rank evaluates its shard with the wrapped module itself (DDP's forward would broadcast
            # buffers from rank 0 on every call: a collective, which hangs when shards differ in batch count); the
            # all-reduced sums are the single-process sums, so every rank gets the same numbers (and decisions)
            loss_total, correct, count = evaluate(model.module, val_loader, device, amp, cfg.eval_mode)
            sums = torch.stack([loss_total, correct, count])
            dist.all_reduce(sums)
            loss_total, correct, count = sums
            # <<< DDP
            val_loss, val_acc = (loss_total / count).item(), (correct / count).item()  # host sync, once per eval
            improved = early.update(val_loss if cfg.monitor == "val_loss" else val_acc, epoch)
            best = {"val_loss": min(val_loss, best.get("val_loss", math.inf)),
                    "val_acc": max(val_acc, best.get("val_acc", -math.inf)), "epoch": early.best_epoch}
            log.row(step=step, epoch=epoch, split="val", loss=val_loss, acc=val_acc,
                    lr=scheduler.get_last_lr()[0], samples_per_s=0.0, time_s=time.perf_counter() - t_start)
            log.print(f"epoch {epoch + 1}/{num_epochs} step {step}: val_loss {val_loss:.4f} "
                      f"val_acc {val_acc:.4f}" + (" (best)" if improved else ""))
        # >>> DDP: rank 0 saves (every rank holds the same weights; raw_model is the unwrapped module, so the keys
        # carry no "module." prefix). The barrier holds every rank until last.pt is on disk: a crash anywhere in
        # the next epoch can then resume from this epoch's end. (Other ranks wait about as long as the write.)
        rng_per_rank = [None] * env.world_size
        dist.all_gather_object(rng_per_rank, capture_rng())  # a collective: every rank sends its RNG streams
        if env.master_process:
            checkpoint = build_checkpoint(
                model_state=amp.model_state_dict(raw_model), optimizer_state=optimizer.state_dict(),
                scheduler=scheduler, amp=amp, early_stopping=early, cfg=cfg, world_size=env.world_size,
                epoch=epoch + 1 if epoch_done else epoch, micro_steps_done=0 if epoch_done else micro_steps_done,
                step=step, samples_seen=samples_seen, best=best, rng_per_rank=rng_per_rank)
            save_checkpoint(checkpoint, out_dir / "last.pt")  # every epoch, atomically
            if improved:
                save_checkpoint(checkpoint, out_dir / "best.pt")
        dist.barrier()
        # <<< DDP
        if early.should_stop:
            log.print(f"early stop: {early.reason}")
            break
        if step == total_steps:
            break

    # ------------------------------------------------------------------ teardown
    progress.close()
    wall_s = time.perf_counter() - t_start
    # >>> DDP: every rank must take the same branch (it all-reduces), so rank 0 says whether best.pt exists;
    # each rank then reads it (several nodes need a shared filesystem, as for --resume)
    best_exists = [(out_dir / "best.pt").exists()]
    dist.broadcast_object_list(best_exists, src=0)
    if cfg.restore_best and best_exists[0]:
        amp.load_model_state_dict(raw_model, load_checkpoint(out_dir / "best.pt")["model"])
        loss_total, correct, count = evaluate(model.module, val_loader, device, amp, cfg.eval_mode)
        sums = torch.stack([loss_total, correct, count])
        dist.all_reduce(sums)
        loss_total, correct, count = sums
        # <<< DDP
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
        log.print(f"restored best weights (epoch {early.best_epoch + 1}): "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
    summary = run_summary(
        # >>> DDP: the summary of the whole group (samples_seen counts every rank's)
        script=SCRIPT, world_size=env.world_size, device=device, cfg=cfg, global_batch_size=global_batch_size,
        epoch=epoch,
        # <<< DDP
        step=step, samples_seen=samples_seen, samples_this_run=samples_seen - samples_at_start, val_loss=val_loss,
        val_acc=val_acc, best=best, early=early, amp=amp, wall_s=wall_s, data_wait_s=data_wait_s,
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr)
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
