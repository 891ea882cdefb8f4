# >>> DDP: the docstring shows torchrun's commands
"""Distributed data parallel training under torchrun: one process per device, gradients all-reduced.

    torchrun --nproc_per_node=4 launch/ddp.py        # make demo: 4 CPU ranks (gloo), >= 0.95 val acc on digits
    python launch/ddp.py                             # the same script as a group of one
    torchrun --nproc_per_node=2 launch/ddp.py --batch-size 16 --epochs 2   # the weights of:
    python launch/single.py --batch-size 32 --epochs 2                      #   (global batch 32 in both)
    torchrun --nproc_per_node=8 launch/ddp.py --device cuda --batch-size 32    # one GPU per rank, nccl
    torchrun --standalone --nproc_per_node=4 --max-restarts 1 launch/ddp.py --out-dir runs/a --resume auto
    torchrun --nproc_per_node=3 launch/ddp.py --dataset synthetic --synthetic-size 77 --batch-size 5   # the weights
    python launch/single.py --dataset synthetic --synthetic-size 77 --batch-size 15                    #   of this

Several nodes, Slurm and static rendezvous: docs/ddp.md, "Single node, several nodes, Slurm".

`diff manual_train/loops/single.py manual_train/loops/ddp.py` is the lesson; every changed line is marked DDP:
  setup ............ rank and device from torchrun's environment, the device bound before init_process_group,
                     destroy_process_group in a finally
  the model ........ DistributedDataParallel: after each backward every rank holds the mean gradient, all-reduced
                     in buckets while backward is still running
  the sampler ...... each rank a disjoint 1/N of one permutation, set_epoch every epoch; no repeats when N does
                     not divide the set: a shard one short ends in an empty micro-batch (weight 0), and every
                     micro-batch is weighted by its share of the global window, so any size trains exactly
  the knobs ........ --bucket-cap-mb, --gradient-as-bucket-view, --static-graph, --find-unused-parameters (DDP's
                     constructor), --comm-hook fp16|bf16|powersgd (lossy): docs/ddp_knobs.md
  accumulation ..... no_sync() on all but a window's last micro-step: one all-reduce per optimizer step
  logging, evaluation  sums all-reduced (all_sum): exactly the single-process numbers, and the same decisions
                     (NaN abort, early stopping) on every rank
Rank 0 alone prints and writes (manual_train/run.py). --backend, --dist-timeout-s and --sync-bn are DDPConfig's
(manual_train/distributed.py). DEFAULTS below differ from the baseline's in --batch-size only: 8 per rank, so 4
ranks train with the baseline's global batch of 32 and its learning rate and schedule (docs/ddp.md).
"""
# <<< DDP
from __future__ import annotations

import math
from contextlib import nullcontext  # DDP

import torch
# >>> DDP
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
# <<< DDP

from manual_train import data
from manual_train.config import Config
# >>> DDP
from manual_train.distributed import DDPConfig, DistEnv, all_sum, comm_hook, pick_device, read_env, setup, teardown
# <<< DDP
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import CastInputs, autocast_for, param_dtype
from manual_train.run import Run
from manual_train.runtime import seed_everything, set_deterministic  # DDP: pick_device, not resolve_device

SCRIPT = "ddp"  # DDP
# >>> DDP: --batch-size is per rank; 8 gives the demo's 4 ranks the baseline's global batch of 32, and with it the
# baseline's learning rate and schedule: the same samples at every step (0.9798 val acc after 10 epochs, as it)
DEFAULTS = dict(batch_size=8)
__all__ = ["DDPConfig", "DEFAULTS", "train"]


def train(cfg: DDPConfig) -> dict:
    # ------------------------------------------------------------------ setup
    # >>> DDP: who this process is (torchrun's environment) and its device; join the group, and leave it on every
    # exit path: destroy_process_group frees the communicators and lets a process join another group later
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
    torch.autograd.set_detect_anomaly(cfg.detect_anomaly)  # --detect-anomaly: backward names the op that made a NaN
    train_ds, val_ds, info = data.build_datasets(cfg)
    # >>> DDP: rank r trains on perm[r::N] of the one permutation and evaluates indices r, r+N, ... of the validation
    # set. No repeats: DistributedSampler pads a set that N does not divide with duplicates (pad=True), which then
    # count twice; here a shard one sample short gets an empty last micro-batch instead, so every rank runs the
    # same micro-steps (n_train below counts ceil(n / N) positions on every rank). The weights below use the whole
    # set's numbers: n_all samples, micro_batch = N x batch samples in each micro-step (fewer in the epoch's last).
    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank, pad=False)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, env.world_size, env.rank), cfg, device,
                                   batch_size=cfg.eval_batch_size)
    micro_batch = cfg.batch_size * env.world_size
    n_all = data.limit_train(len(train_ds), cfg, micro_batch)  # --limit-train-batches: this epoch's samples
    # <<< DDP
    n_train = data.limit_train(len(sampler), cfg)  # --limit-train-batches (--fast-dev-run: 1): the epoch's samples
    global_batch_size = cfg.batch_size * cfg.accumulate * env.world_size  # DDP: what one optimizer step averages
    micro_steps_per_epoch = data.micro_batches_per_epoch(n_train, cfg.batch_size)
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)
    run = Run(cfg, SCRIPT, device=device, lr=lr, global_batch_size=global_batch_size, total_steps=total_steps,
              micro_steps_per_epoch=micro_steps_per_epoch, datasets=(train_ds, val_ds), env=env)  # DDP: rank 0 writes

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision)).to(device)  # moved once
    # >>> DDP: --sync-bn: BatchNorm statistics over the global batch, one extra all-reduce per BatchNorm layer in
    # every forward (CUDA only, refused on the CPU by DDPConfig.validate)
    if cfg.sync_bn:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    # <<< DDP
    model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model  # 64-true: float64 inputs too
    # >>> DDP: the constructor broadcasts rank 0's parameters and buffers, so every rank starts from the same
    # weights; it then hooks autograd so that backward all-reduces (averages) gradients in ~25 MB buckets as
    # soon as each bucket's gradients exist, overlapping communication with the rest of backward.
    # DDP's knobs (docs/ddp_knobs.md): each keeps the weights bit for bit; only a comm hook changes them (lossy).
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cfg.bucket_cap_mb,  # small buckets start sending sooner but cost more calls
                gradient_as_bucket_view=cfg.gradient_as_bucket_view,  # .grad lives in its bucket: one copy less
                static_graph=cfg.static_graph,  # the same parameters every step: buckets planned once
                find_unused_parameters=cfg.find_unused_parameters)  # walk each graph for unused ones (slower)
    if cfg.comm_hook != "none":  # fp16, bf16, powersgd: fewer bytes per all-reduce, lossy (distributed.comm_hook)
        model.register_comm_hook(*comm_hook(cfg, model))
    # the weights are equal on every rank; from here each rank draws its own random numbers (dropout masks,
    # augmentations, DataLoader workers' seeds), not one stream N times over
    seed_everything(cfg.seed + env.rank)
    # <<< DDP
    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    # torch.amp: autocast runs forward and loss in float16 (16-mixed) or bfloat16 (bf16-mixed) where that is safe.
    # fp16 gradients of small losses underflow to zero, so 16-mixed multiplies the loss by a large scale before
    # backward and divides the gradients by it after; bf16 has fp32's range and needs no scaling. Disabled, the
    # GradScaler passes everything through (scale 1).
    autocast = autocast_for(cfg.precision, device)
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale_init, enabled=cfg.precision == "16-mixed",
                                  growth_interval=cfg.loss_scale_growth_interval)
    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)  # --resume loads into these

    # ------------------------------------------------------------------ training loop
    # Running sums stay on the device: adding loss.detach() costs no host sync and keeps no graph.
    loss_sum = torch.zeros((), device=device)
    correct_sum = torch.zeros((), device=device)
    log_steps = log_targets = 0
    val_loss = val_acc = math.nan
    epoch = start_epoch - 1  # epochs_run stays right when a finished run is resumed
    for epoch in range(start_epoch, num_epochs):
        # A new permutation every epoch (else every epoch repeats the first); a resumed epoch starts where its
        # checkpoint stopped, micro-batch start_micro_step (the loader never loads the batches before it).
        first = start_micro_step if epoch == start_epoch else 0
        sampler.set_epoch(epoch, start=first * cfg.batch_size)
        model.train()
        for micro_step, (x, y) in enumerate(run.timed(train_loader), start=first):
            # non_blocking=True: from pinned memory the copy is asynchronous and overlaps compute.
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == micro_steps_per_epoch
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            # >>> DDP: the window is the GLOBAL one, every rank's samples of it, and DDP divides the all-reduced sum by
            # N, so each rank's share is times N: the mean over the window's samples also when ranks' micro-batches
            # differ in size (weighting by a rank's own window, a mean of ranks' means, is 2e-2 off on 77 samples).
            # An empty micro-batch (weight 0) still runs forward and backward, so its rank joins the all-reduce with
            # exact zeros: torch's Join written out, except that every rank then also steps, logs and saves (under
            # Join the rank that ran out skips the step, and its momentum falls behind: docs/ddp_knobs.md).
            weight = x.shape[0] * env.world_size / data.window_samples(n_all, micro_batch, cfg.accumulate, micro_step)
            # <<< DDP

            # >>> DDP: inside no_sync() backward only adds into each rank's own .grad; the window's last micro-step
            # runs outside it and its backward all-reduces the accumulated sums. One all-reduce per optimizer step,
            # not per micro-batch, and the same mean gradient. (Forward is inside too: DDP prepares the reducer there.)
            with nullcontext() if window_end else model.no_sync():
                with autocast():  # forward and loss only: backward runs in the dtypes forward chose
                    logits = model(x)
                    loss = loss_fn(logits, y)
                scaler.scale(loss * weight).backward()  # 16-mixed: the scaled loss; gradients accumulate scaled
            # <<< DDP

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (summing `loss` itself would chain every step's graph).
            loss_sum += loss.detach() * weight if weight else 0  # DDP: an empty micro-batch's mean loss is NaN (0/0)
            correct_sum += correct_count(logits.detach(), y)
            log_targets += y.numel()
            samples_seen += data.window_samples(n_all, micro_batch, 1, micro_step)  # DDP: every rank's, this micro-step

            if window_end:
                scaler.unscale_(optimizer)  # true gradients before clipping (a no-op when the scaler is off)
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
                if cfg.grad_clip_value:  # every element into [-v, v]: the direction changes (norm clipping keeps it)
                    torch.nn.utils.clip_grad_value_(raw_model.parameters(), cfg.grad_clip_value)
                scaler.step(optimizer)  # 16-mixed: skipped when the gradients hold inf/NaN
                scaler.update()  # 16-mixed: halve the scale after a skip, double it after growth_interval clean steps
                if run.stepped(scaler):  # a skipped step does not advance the schedule (Lightning's does)
                    scheduler.step()
                step += 1
                log_steps += 1
                run.profile(step)  # --profile: torch.profiler's schedule moves one optimizer step on
                if step % cfg.log_every == 0 or micro_step + 1 == micro_steps_per_epoch or step == total_steps:
                    # >>> DDP: the log window's sums from every rank: the logged loss becomes the global mean, and a
                    # NaN on any rank reaches every rank, so they all stop together. One small all-reduce per log row.
                    loss_total, correct_total, targets = all_sum(loss_sum, correct_sum, log_targets, device=device)
                    # .item() is a host sync: it waits for every queued kernel. Here once per log row.
                    train_loss = (loss_total / (log_steps * env.world_size)).item()
                    train_acc = (correct_total / targets).item()
                    # <<< DDP
                    run.log_train(step, epoch, train_loss, train_acc, scheduler.get_last_lr()[0], samples_seen,
                                  log_steps)  # metrics.csv; a NaN loss stops the run here
                    loss_sum.zero_(), correct_sum.zero_()
                    log_steps = log_targets = 0
                # --val-every-steps, --checkpoint-every-steps: validation and last.pt inside a long epoch too (the
                # epoch's end has its own, below). A validation that improved is saved at once (best.pt), while the
                # weights are the evaluated ones; a resume from here starts at the next micro-batch, exactly.
                mid_epoch = micro_step + 1 < micro_steps_per_epoch and step < total_steps
                if cfg.val_every_steps and step % cfg.val_every_steps == 0 and mid_epoch:
                    # >>> DDP: as at the epoch's end, below
                    loss_total, correct, count = evaluate(model.module, val_loader, device, autocast, cfg.eval_mode)
                    loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
                    # <<< DDP
                    val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
                    run.log_val(step, epoch, val_loss, val_acc, scheduler.get_last_lr()[0])  # and early stopping
                save_due = cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0
                if (save_due or run.improved) and mid_epoch:
                    run.save(epoch, micro_step + 1, step, samples_seen)  # last.pt mid-epoch (best.pt), atomically
                # every step done, early stopping, --max-time; or the end of a --limit-train-batches epoch
                if run.should_stop(step) or micro_step + 1 == micro_steps_per_epoch:
                    break

        # -------------------------------------------------------------- evaluate, stop early, checkpoint
        # (not again at a step a mid-epoch validation has just evaluated, nor when stopping right after it)
        if ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == num_epochs or run.stopping) and run.val_step != step:
            # >>> DDP: each rank evaluates its shard with the wrapped module itself (DDP's forward would broadcast
            # buffers from rank 0 on every call: a collective, which hangs when shards differ in batch count); the
            # all-reduced sums are the single-process sums, so every rank gets the same numbers (and decisions)
            loss_total, correct, count = evaluate(model.module, val_loader, device, autocast, cfg.eval_mode)
            loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
            # <<< DDP
            val_loss, val_acc = (loss_total / count).item(), (correct / count).item()  # host sync, once per eval
            run.log_val(step, epoch, val_loss, val_acc, scheduler.get_last_lr()[0])  # and early stopping
        run.save(epoch, micro_step + 1, step, samples_seen)  # last.pt every epoch (best.pt), atomically
        if run.should_stop(step):  # early stopping, or every step done
            break

    # ------------------------------------------------------------------ teardown
    restored = run.restore_best()  # --restore-best: best.pt's weights back into raw_model
    if restored:
        # >>> DDP: as above
        loss_total, correct, count = evaluate(model.module, val_loader, device, autocast, cfg.eval_mode)
        loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
        # <<< DDP
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
    return run.finish(epoch, step, samples_seen, val_loss, val_acc, restored=restored)  # summary.json
