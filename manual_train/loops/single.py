"""Single-device training: the baseline; every other loop in manual_train is a diff of it, directly or through ddp.py.

    python launch/single.py                                 # cnn on digits, >= 0.95 val acc, ~20 s on 2 CPU cores
    python launch/single.py --batch-size 16 --accumulate 4  # the same weights as --batch-size 64
    python launch/single.py --precision bf16-mixed --num-workers 2 --pin-memory
    python launch/single.py --resume runs/single-<time>/last.pt  # with the run's own flags: continues where it stopped

Reads top to bottom: setup, the loop, teardown. The techniques are the commented lines:
  DataLoader tuning ........ data.build_loader (workers, pinning, prefetch) and .to(non_blocking=True)
  gradient accumulation .... micro-batch loss weights, zero_grad at window start, one step per window
  precision ................ torch.autocast around forward and loss; a GradScaler, enabled for 16-mixed only
  logging .................. loss.detach() and argmax kept on the device, summed and .item() only at log steps
  evaluation ............... evaluation.evaluate under no_grad or inference_mode, exact sums
Outputs, checkpoints, exact resume, early stopping and the summary are `run.` calls (manual_train/run.py).
"""
from __future__ import annotations

import math

import torch

from manual_train import data
from manual_train.config import Config
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, log_sums, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.plugins import build_loss
from manual_train.precision import CastInputs, autocast_for, param_dtype
from manual_train.run import Run
from manual_train.runtime import resolve_device, seed_everything, set_deterministic

SCRIPT = "single"


def train(cfg: Config) -> dict:
    # ------------------------------------------------------------------ setup
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    torch.autograd.set_detect_anomaly(cfg.detect_anomaly)  # --detect-anomaly: backward names the op that made a NaN
    train_ds, val_ds, info = data.build_datasets(cfg)
    sampler = data.train_sampler(train_ds, cfg.seed)  # DistributedSampler's order at world size 1
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(val_ds, cfg, device, batch_size=cfg.eval_batch_size)
    n_train = data.limit_train(len(sampler), cfg)  # --limit-train-batches (--fast-dev-run: 1): the epoch's samples
    global_batch_size = cfg.batch_size * cfg.accumulate
    micro_steps_per_epoch = data.micro_batches_per_epoch(n_train, cfg.batch_size)
    windows = data.Windows(train_ds, sampler, cfg)  # the targets of each micro-batch and window, every rank's
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)
    run = Run(cfg, SCRIPT, device=device, lr=lr, global_batch_size=global_batch_size, total_steps=total_steps,
              micro_steps_per_epoch=micro_steps_per_epoch, datasets=(train_ds, val_ds))  # checks --resume

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision)).to(device)  # moved once
    model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model  # 64-true: float64 inputs too
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
        loss_total, correct, count = evaluate(model, val_loader, device, autocast, cfg.eval_mode, criterion)
        return (loss_total / count).item(), (correct / count).item()

    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=raw_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)  # --resume loads into these

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
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == micro_steps_per_epoch
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's targets (labels, or
            # tokens of text), so the window's gradient is the mean over all its targets, as one big batch (also for
            # the epoch's last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            targets, window_targets = windows.count(micro_step)  # from the sampled indices (data.Windows)
            weight = targets / window_targets

            with autocast():  # forward and loss only: backward runs in the dtypes forward chose
                logits = model(x)
                loss = criterion(logits, y) * weight  # the micro-batch's share of the window's mean
            scaler.scale(loss).backward()  # 16-mixed: the scaled loss; gradients accumulate scaled

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (keeping `loss` itself would keep the step's graph).
            losses.append(loss.detach())
            if cfg.train_acc:  # --no-train-acc: none (Lightning logs no train accuracy unless asked)
                predictions.append(logits.detach().argmax(-1)), labels.append(y)
            log_targets += targets
            samples_seen += x.shape[0]

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
                    # .item() is a host sync: it waits for every queued kernel. Here once per log row.
                    train_loss = loss_sum.item() / log_steps
                    train_acc = correct.item() / log_targets
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
    return run.finish(epoch, step, samples_seen, val_loss, val_acc, restored=restored)  # summary.json
