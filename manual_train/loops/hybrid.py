# >>> HYBRID: the docstring shows this script's commands and what its diff teaches
"""Hybrid data + model parallelism: seq2seq split over two devices, and that split replicated (tag HYBRID).

    python launch/hybrid.py --mode dp-mp                              # one process (CPU: cpu,cpu,cpu,cpu)
    python launch/hybrid.py --mode dp-mp --devices cuda:0,cuda:1,cuda:2,cuda:3   # encoder on 0,1; decoder on 2,3
    torchrun --nproc_per_node=2 launch/hybrid.py --mode ddp-mp        # each rank: encoder on A, decoder on B
    torchrun --nproc_per_node=4 launch/hybrid.py --mode ddp-mp        # on 8 GPUs: rank r owns cuda:2r, cuda:2r+1

`diff manual_train/loops/single.py manual_train/loops/hybrid.py` is the lesson; every changed line is marked
HYBRID: the split (hybrid.split_model, by --mode) and loops/ddp.py's recipe around it. N ranks with
--batch-size b train the weights of one process with N*b, on any set size. What each change does: docs/hybrid.md.
HybridConfig (manual_train/hybrid.py) is a DDPConfig: --backend, --dist-timeout-s, and DDP's knobs under
ddp-mp (dp-mp refuses them; --sync-bn is refused: seq2seq has no BatchNorm). DEFAULTS: launch/model_parallel.py's
task and budget.
"""
# <<< HYBRID
from __future__ import annotations

import math
from contextlib import nullcontext  # HYBRID

import torch
from torch.nn.parallel import DistributedDataParallel as DDP  # HYBRID

from manual_train import data
from manual_train.distributed import DistEnv, all_sum, process_group, with_comm_hook  # HYBRID
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, log_sums, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
# >>> HYBRID: the config, the split and the summary's device keys (device lists replace resolve_device)
from manual_train.hybrid import DEFAULTS, HybridConfig, describe, split_model, summary_extra
from manual_train.plugins import build_loss
from manual_train.precision import autocast_for, param_dtype
from manual_train.run import Run
from manual_train.runtime import seed_everything, set_deterministic

SCRIPT = "hybrid"
__all__ = ["DEFAULTS", "HybridConfig", "train"]


def train(cfg: HybridConfig) -> dict:
    # the process group as loops/ddp.py joins it (--backend, --dist-timeout-s; plain python: a group of one), left on
    # every exit path; not bound to one GPU: DDP broadcasts on both of the pair's devices, the sums use the decoder's
    with process_group(cfg, bind_device=False) as (env, _):
        return train_rank(cfg, env, *cfg.device_groups(env))  # the encoder's devices, the decoder's


def train_rank(cfg: HybridConfig, env: DistEnv, group_a: list, group_b: list) -> dict:
    # <<< HYBRID
    # ------------------------------------------------------------------ setup
    device = group_b[0]  # HYBRID: the decoder's: where the logits, the loss, the sums and evaluation live
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    torch.autograd.set_detect_anomaly(cfg.detect_anomaly)  # --detect-anomaly: backward names the op that made a NaN
    train_ds, val_ds, info = data.build_datasets(cfg)
    # >>> HYBRID: rank r trains on perm[r::N] and evaluates val[r::N], without repeats, as loops/ddp.py; the weights
    # use the whole set's numbers: n_all samples, N x batch in each micro-step (fewer in the last)
    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank, pad=False)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, env.world_size, env.rank), cfg, device,
                                   batch_size=cfg.eval_batch_size)
    micro_batch = cfg.batch_size * env.world_size
    n_all = data.limit_train(len(train_ds), cfg, micro_batch)  # --limit-train-batches: this epoch's samples
    # <<< HYBRID
    n_train = data.limit_train(len(sampler), cfg)  # --limit-train-batches (--fast-dev-run: 1): the epoch's samples
    global_batch_size = cfg.batch_size * cfg.accumulate * env.world_size  # HYBRID: what one optimizer step averages
    micro_steps_per_epoch = data.micro_batches_per_epoch(n_train, cfg.batch_size)
    windows = data.Windows(train_ds, sampler, cfg)  # the targets of each micro-batch and window, every rank's
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)
    run = Run(cfg, SCRIPT, device=device, lr=lr, global_batch_size=global_batch_size, total_steps=total_steps,
              micro_steps_per_epoch=micro_steps_per_epoch, datasets=(train_ds, val_ds),  # HYBRID
              env=env)  # HYBRID: rank 0 alone writes; every rank joins the collectives run's calls make

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision))  # HYBRID: the split places it
    # >>> HYBRID: each half moved once, to its device (token ids: 64-true casts none). DDP over the split without
    # device_ids (it spans two devices), with loops/ddp.py's knobs (ddp-mp); dp-mp is a group of one: the average of
    # one (docs/hybrid.md, "--mode ddp-mp")
    model = with_comm_hook(DDP(split_model(cfg, raw_model, group_a, group_b), **cfg.ddp_kwargs(device=None)), cfg)
    seed_everything(cfg.seed + env.rank)  # the weights are equal now; each rank draws its own random numbers
    # <<< HYBRID
    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    # torch.amp: autocast runs forward and loss in float16 (16-mixed) or bfloat16 (bf16-mixed) where that is safe.
    # fp16 gradients of small losses underflow to zero, so 16-mixed multiplies the loss by a large scale before
    # backward and divides the gradients by it after; bf16 has fp32's range and needs no scaling. Disabled, the
    # GradScaler passes everything through (scale 1).
    autocast = autocast_for(cfg.precision, device)
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale_init, enabled=cfg.precision == "16-mixed",
                                  growth_interval=cfg.loss_scale_growth_interval)
    criterion = build_loss(cfg, loss_fn)  # the mean cross-entropy, or yours (--loss: docs/your-model.md)

    def validate() -> tuple[float, float]:
        """The validation set's mean loss and accuracy: exact sums, one host sync (.item())."""
        # >>> HYBRID: this rank's shard through the split itself (DDP's forward broadcasts buffers: a collective, which
        # hangs when shards differ in batch count); the summed sums are one process's, the same on every rank
        loss_total, correct, count = evaluate(model.module, val_loader, device, autocast, cfg.eval_mode, criterion)
        loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
        # <<< HYBRID
        return (loss_total / count).item(), (correct / count).item()

    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)  # --resume loads into these
    run.print(describe(cfg, group_a, group_b, env))  # HYBRID: where each half runs, under the banner

    # ------------------------------------------------------------------ training loop
    # Logging keeps each micro-step's detached loss and predictions on the device until the log row sums them:
    # no host sync, no graph kept, one tensor op per micro-step (the argmax).
    losses, predictions, labels = [], [], []
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
            y = y.to(device, non_blocking=True)  # HYBRID: the targets go where the logits come out; x stays put
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == micro_steps_per_epoch
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's targets (labels, or
            # tokens of text), so the window's gradient is the mean over all its targets, as one big batch (also for
            # the epoch's last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            targets, window_targets = windows.count(micro_step)  # from the sampled indices (data.Windows)
            # >>> HYBRID: the window is the GLOBAL one, every rank's samples of it, and DDP divides the all-reduced sum
            # by N, so each rank's share is times N: the window's mean also when ranks' micro-batches differ in size
            # (an empty one, weight 0, joins the all-reduce with exact zeros). dp-mp (N = 1): the baseline's weight.
            weight = targets * env.world_size / window_targets
            # <<< HYBRID

            # >>> HYBRID: inside no_sync() backward only adds into each rank's own .grad; the window's last micro-step
            # runs outside it and its backward all-reduces the accumulated sums. One all-reduce per optimizer step,
            # not per micro-batch, and the same mean gradient. (Forward is inside too: DDP prepares the reducer there.)
            with nullcontext() if window_end else model.no_sync():
                with autocast():  # forward and loss only: backward runs in the dtypes forward chose
                    logits = model(x)
                    loss = criterion(logits, y) * weight  # the micro-batch's share of the window's mean
                scaler.scale(loss).backward()  # 16-mixed: the scaled loss; gradients accumulate scaled
            # <<< HYBRID

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (keeping `loss` itself would keep the step's graph).
            losses.append(loss.detach() if weight else torch.zeros_like(loss))  # HYBRID: an empty batch's mean: NaN
            if cfg.train_acc:  # --no-train-acc: none (Lightning logs no train accuracy unless asked)
                predictions.append(logits.detach().argmax(-1)), labels.append(y)
            log_targets += targets
            samples_seen += data.window_samples(n_all, micro_batch, 1, micro_step)  # HYBRID: every rank's, this step

            if window_end:
                scaler.unscale_(optimizer)  # true gradients before clipping (a no-op when the scaler is off)
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
                if cfg.grad_clip_value:  # every element into [-v, v]: the direction changes (norm clipping keeps it)
                    torch.nn.utils.clip_grad_value_(raw_model.parameters(), cfg.grad_clip_value)
                scaler.step(optimizer)  # 16-mixed: skipped when the gradients hold inf/NaN
                scaler.update()  # 16-mixed: halve the scale after a skip, double it after growth_interval clean steps
                if run.stepped(scaler, losses):  # a skipped step does not advance the schedule (Lightning's does)
                    scheduler.step()
                step += 1
                log_steps += 1
                run.profile(step)  # --profile: torch.profiler's schedule moves one optimizer step on
                if step % cfg.log_every == 0 or micro_step + 1 == micro_steps_per_epoch or step == total_steps:
                    loss_sum, correct = log_sums(losses, predictions, labels, device)  # 3 tensor ops per row
                    # >>> HYBRID: the log window's sums from every rank: the logged loss becomes the global mean, and a
                    # NaN on any rank reaches every rank, so they all stop together. One small all-reduce per log row.
                    loss_total, correct_total, targets = all_sum(loss_sum, correct, log_targets, device=device)
                    # .item() is a host sync: it waits for every queued kernel. Here once per log row.
                    train_loss = (loss_total / (log_steps * env.world_size)).item()
                    train_acc = (correct_total / targets).item()
                    # <<< HYBRID
                    run.log_train(step, epoch, train_loss, train_acc, scheduler.get_last_lr()[0], samples_seen,
                                  log_steps)  # metrics.csv; a NaN loss stops the run here
                    losses, predictions, labels = [], [], []
                    log_steps = log_targets = 0
                # --val-every-steps, --checkpoint-every-steps: validation and last.pt inside a long epoch too (the
                # epoch's end has its own, below). A validation that improved is saved at once (best.pt), while the
                # weights are the evaluated ones; a resume from here starts at the next micro-batch, exactly.
                mid_epoch = micro_step + 1 < micro_steps_per_epoch and step < total_steps
                if cfg.val_every_steps and step % cfg.val_every_steps == 0 and mid_epoch:
                    val_loss, val_acc = validate()
                    run.log_val(step, epoch, val_loss, val_acc, scheduler.get_last_lr()[0])  # and early stopping
                save_due = cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0
                if (save_due or run.improved) and mid_epoch:
                    run.save(epoch, micro_step + 1, step, samples_seen)  # last.pt mid-epoch (best.pt), atomically
                # every step done, early stopping, --max-time; or the end of a --limit-train-batches epoch
                if run.should_stop(step) or micro_step + 1 == micro_steps_per_epoch:
                    break

        # -------------------------------------------------------------- evaluate, stop early, checkpoint
        # (not again at a step a mid-epoch validation has just evaluated, nor when stopping right after it; a
        # preemption notice saves at once, unevaluated: the scheduler's SIGKILL follows it)
        due = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == num_epochs or run.stopping
        if due and run.val_step != step and not run.preempted:
            val_loss, val_acc = validate()  # host sync, once per eval
            run.log_val(step, epoch, val_loss, val_acc, scheduler.get_last_lr()[0])  # and early stopping
        run.save(epoch, micro_step + 1, step, samples_seen)  # last.pt every epoch (best.pt), atomically
        if run.should_stop(step):  # early stopping, or every step done
            break

    # ------------------------------------------------------------------ teardown
    restored = run.restore_best()  # --restore-best: best.pt's weights back into raw_model
    if restored:
        val_loss, val_acc = validate()
    # >>> HYBRID: summary.json also says the mode and where each half ran
    return run.finish(epoch, step, samples_seen, val_loss, val_acc, restored=restored,
                      **summary_extra(cfg, group_a, group_b))  # summary.json
    # <<< HYBRID
