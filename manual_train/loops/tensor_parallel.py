# >>> TP: the docstring: what is split, the commands, and what differs from the ZeRO loop
"""Tensor parallelism under torchrun: every attention and MLP of the GPT split over --tp ranks (Megatron-LM's
column/row split, torch.distributed.tensor.parallel), and 2-D: FSDP2 over --dp replicas of that
(docs/tensor_parallel.md).

    torchrun --nproc_per_node=2 launch/tensor_parallel.py                  # --tp 2: every rank the same batches
    torchrun --nproc_per_node=4 launch/tensor_parallel.py --dp 2 --tp 2    # 2-D: a (dp 2, tp 2) DeviceMesh
    torchrun --nproc_per_node=2 launch/tensor_parallel.py --sequence-parallel   # LayerNorms on s/tp positions each
    torchrun --nproc_per_node=2 launch/tensor_parallel.py --epochs 1 --out-dir T   # the weights of (1e-9 in 64-true):
    python launch/single.py --model gpt --dataset reverse --optimizer adamw --lr 3e-3 --batch-size 16 --epochs 1
    python launch/single.py --resume T/last.pt --model gpt --dataset reverse ...   # its checkpoint is a plain one

`diff manual_train/loops/zero.py manual_train/loops/tensor_parallel.py` is the lesson; every changed line is marked
TP. Its parent is the ZeRO loop because 2-D is ZeRO's FSDP2 with TP inside each replica; with --dp 1 nothing is
sharded by FSDP and the loop is TP alone. What differs from the ZeRO loop:
  the mesh ......... ranks r*tp .. r*tp+tp-1 form data-parallel replica r (dp_coords): the sampler, the validation
                     shard, the batch sizes and the per-rank seed count replicas, not ranks; a replica's tp ranks
                     load the same batches and draw the same dropout masks
  the model ........ parallelize() (manual_train/tensor_parallelism.py) in place of shard(): ColwiseParallel q, k,
                     v and MLP fc, RowwiseParallel projections, every other parameter replicated on the tp mesh (the
                     DTensor/foreach trap), then FSDP2 over dp; it returns zero's interface, so the step, clipping,
                     evaluation and checkpoints are the ZeRO loop's calls unchanged
  logging .......... unchanged: all_sum over every rank counts each replica tp times, in the numerator and the
                     denominator alike, so the logged means are the baseline's
  checkpoints ...... the full GPT in its own layout: single.py resumes it, and this loop resumes any loop's GPT
                     checkpoint; --checkpoint-format dcp: every rank's shards, resumable at another --dp x --tp or
                     in one process
  the end .......... bytes held per rank next to the formula (bytes communicated: manual_train/bench/tensor_parallel.py)
DEFAULTS: the GPT on the reverse task (docs/gpt.md), --batch-size 16 per replica (--dp 2: the baseline's 32).
"""
# <<< TP
from __future__ import annotations

import math
# ZERO: no contextlib.nullcontext: sharded.no_sync() chooses the context

import torch
import torch.nn as nn  # ZERO: no DistributedDataParallel: shard() builds the wrapper

from manual_train import data
from manual_train.config import Config
from manual_train.distributed import DistEnv, all_sum, pick_device, read_env, setup, teardown  # ZERO: not DDPConfig
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import CastInputs, autocast_for, param_dtype
from manual_train.run import Run
from manual_train.runtime import seed_everything, set_deterministic  # DDP: pick_device, not resolve_device
from manual_train.tensor_parallelism import TPConfig, dp_coords, parallelize  # TP: zero.py's flags plus the mesh's

SCRIPT = "tensor_parallel"  # TP
# >>> TP: the GPT on its task, as launch/pipeline.py. --batch-size is per replica: 16 gives --dp 2 the baseline's
# global batch of 32, and with it the baseline's run (0.999 val acc); --tp 2 alone steps twice as often (1.000)
DEFAULTS = dict(model="gpt", dataset="reverse", optimizer="adamw", lr=3e-3, epochs=4, batch_size=16)
__all__ = ["TPConfig", "DEFAULTS", "train"]
# <<< TP


def train(cfg: TPConfig) -> dict:  # TP
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


def train_rank(cfg: TPConfig, env: DistEnv, device: torch.device) -> dict:  # TP
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
    # >>> TP: N is the number of replicas (dp), r this rank's replica: the tp ranks of a replica share its batches
    dp, dp_rank = dp_coords(cfg, env)
    sampler = data.train_sampler(train_ds, cfg.seed, dp, dp_rank, pad=False)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, dp, dp_rank), cfg, device, batch_size=cfg.eval_batch_size)
    micro_batch = cfg.batch_size * dp
    # <<< TP
    n_all = data.limit_train(len(train_ds), cfg, micro_batch)  # --limit-train-batches: this epoch's samples
    # <<< DDP
    n_train = data.limit_train(len(sampler), cfg)  # --limit-train-batches (--fast-dev-run: 1): the epoch's samples
    global_batch_size = cfg.batch_size * cfg.accumulate * dp  # TP: what one optimizer step averages: replicas'
    micro_steps_per_epoch = data.micro_batches_per_epoch(n_train, cfg.batch_size)
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)
    run = Run(cfg, SCRIPT, device=device, lr=lr, global_batch_size=global_batch_size, total_steps=total_steps,
              micro_steps_per_epoch=micro_steps_per_epoch, datasets=(train_ds, val_ds), env=env,  # TP
              replicas=dp)  # TP: rank 0 writes; dp replicas train on shares of every batch

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision)).to(device)  # moved once
    # >>> DDP: --sync-bn: BatchNorm statistics over the global batch, one extra all-reduce per BatchNorm layer in
    # every forward (CUDA only, refused on the CPU by DDPConfig.validate)
    if cfg.sync_bn:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    # <<< DDP
    model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model  # 64-true: float64 inputs too
    # >>> ZERO: in place of DDP's wrapper: the baseline's optimizer, unchanged, then shard() decides from --impl and
    # --stage, once: it wraps raw_model (CastInputs stays outermost) and rebuilds the optimizer's class and
    # hyper-parameters around this rank's shard (ZeroRedundancyOptimizer, OSS) or the sharded parameters (FSDP).
    # Stage 1 and fairscale's stage 2 broadcast rank 0's weights as DDP does; FSDP needs none (every rank built the
    # same weights from the seed). Its forward is a collective, so every rank evaluates as many batches.
    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)
    sharded = parallelize(model, optimizer, cfg, device)  # TP: the mesh, TP, then FSDP2 over dp (--dp > 1)
    model, optimizer = sharded.model, sharded.optimizer
    val_loader = sharded.same_batch_count(val_loader)
    # the weights are equal on every rank; from here each rank draws its own random numbers (dropout masks,
    # augmentations, DataLoader workers' seeds), not one stream N times over
    seed_everything(cfg.seed + dp_rank)  # TP: a replica's tp ranks draw the same masks on replicated activations
    # <<< ZERO
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    # torch.amp: autocast runs forward and loss in float16 (16-mixed) or bfloat16 (bf16-mixed) where that is safe.
    # fp16 gradients of small losses underflow to zero, so 16-mixed multiplies the loss by a large scale before
    # backward and divides the gradients by it after; bf16 has fp32's range and needs no scaling. Disabled, the
    # GradScaler passes everything through (scale 1).
    autocast = autocast_for(cfg.precision, device)
    # >>> ZERO: 16-mixed with sharded gradients (stage 2, 3): torch.amp's GradScaler would check only this rank's
    # shard for inf/NaN, so one rank could skip a step the others take; a ShardedGradScaler all-reduces the check.
    # Checkpoints hold the plain full state: full_model/full_optimizer.state_dict() gather it (every rank calls
    # it, rank 0 writes), load_state_dict() keeps this rank's shard of a full state (any loop's checkpoint).
    scaler = sharded.grad_scaler(device.type, init_scale=cfg.loss_scale_init, enabled=cfg.precision == "16-mixed",
                                 growth_interval=cfg.loss_scale_growth_interval)
    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=sharded.full_model, optimizer=sharded.full_optimizer, scheduler=scheduler, scaler=scaler)
    run.print(f"tensor parallel: {sharded}")  # TP: the mesh, the styles and the optimizer parallelize() chose
    # <<< ZERO

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
                sharded.zero_grad()  # ZERO: optimizer.zero_grad, but ShardedDDP zeroes its reduce buckets in place
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            # >>> DDP: the window is the GLOBAL one, every rank's samples of it, and DDP divides the all-reduced sum by
            # N, so each rank's share is times N: the mean over the window's samples also when ranks' micro-batches
            # differ in size (weighting by a rank's own window, a mean of ranks' means, is 2e-2 off on 77 samples).
            # An empty micro-batch (weight 0) still runs forward and backward, so its rank joins the all-reduce with
            # exact zeros: torch's Join written out, except that every rank then also steps, logs and saves (under
            # Join the rank that ran out skips the step, and its momentum falls behind: docs/ddp_knobs.md).
            weight = x.shape[0] * dp / data.window_samples(n_all, micro_batch, cfg.accumulate, micro_step)  # TP
            # <<< DDP

            # >>> DDP: inside no_sync() backward only adds into each rank's own .grad; the window's last micro-step
            # runs outside it and its backward all-reduces the accumulated sums. One all-reduce per optimizer step,
            # not per micro-batch, and the same mean gradient. (Forward is inside too: DDP prepares the reducer there.)
            with sharded.no_sync(window_end):  # ZERO: DDP's, ShardedDDP's; none under FSDP (gradients stay sharded)
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
                    sharded.clip_grad_norm(cfg.grad_clip)  # ZERO: the norm over every rank's shard (a collective)
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
                    # >>> ZERO: as at the epoch's end, below
                    loss_total, correct, count = evaluate(sharded.eval_model, val_loader, device, autocast,
                                                          cfg.eval_mode)
                    sharded.reshard()
                    # <<< ZERO
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
            # >>> ZERO: FSDP evaluates through its own forward (it gathers the parameters), the others DDP's way;
            # then FSDP2's stage 2 frees what a forward without backward left gathered
            loss_total, correct, count = evaluate(sharded.eval_model, val_loader, device, autocast, cfg.eval_mode)
            sharded.reshard()
            # <<< ZERO
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
        # >>> ZERO: as above; run.restore_best() loaded best.pt's full weights into every rank's shard
        loss_total, correct, count = evaluate(sharded.eval_model, val_loader, device, autocast, cfg.eval_mode)
        sharded.reshard()
        # <<< ZERO
        loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
        # <<< DDP
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
    # >>> ZERO: what each rank holds now (parameters, gradients, optimizer state; gathered from every rank) next to
    # the paper's formulas for this stage and for DDP: a table on the console, the numbers in summary.json
    table, memory = sharded.memory_report()
    run.print(table)
    return run.finish(epoch, step, samples_seen, val_loss, val_acc, restored=restored, **memory)  # summary.json
    # <<< ZERO
