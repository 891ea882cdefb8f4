# >>> APEX_O2: the docstring shows this lesson's commands
"""apex's O2 written out: an fp16 model, fp32 master weights, a dynamic loss scale (the first article's tip 7).

    python launch/apex_o2.py                                    # 16-o2: cnn on digits, >= 0.95 val acc (fp16
                                                                # convolutions are slow on CPUs: minutes on 2 cores)
    python launch/apex_o2.py --model mlp --max-steps 120        # single.py --precision 16-mixed's trajectory, to
                                                                # rounding (docs/precision.md)
    python launch/apex_o2.py --precision apex-o2 --device cuda  # apex.amp itself (apex <= 25.05, from source)

`diff manual_train/loops/single.py manual_train/loops/apex_o2.py` is the lesson; every changed line is marked APEX_O2:
fp32 masters cloned first, the model cast to fp16 except BatchNorm, a scaled loss, the fp16 gradients unscaled into
the masters, a step that an overflow skips, the masters copied back. --precision apex-o2 lets apex.amp do all of
it. Each step and why: docs/apex_o2.md; the pieces and ApexO2Config are in manual_train/apex_o2.py.
"""
# <<< APEX_O2
from __future__ import annotations

import math

import torch

from manual_train import data
from manual_train.config import Config
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, log_sums, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
# >>> APEX_O2: its flags (ApexO2Config) and the small pieces it reuses (manual_train/apex_o2.py)
from manual_train.plugins import build_loss
from manual_train.apex_o2 import (ApexO2Config, ApexScaler, DynamicLossScaler, O2Forward, O2Masters, apex_amp_or_error,
                                  cast_o2)
from manual_train.precision import autocast_for, param_dtype
# <<< APEX_O2
from manual_train.run import Run
from manual_train.runtime import resolve_device, seed_everything, set_deterministic

SCRIPT = "apex_o2"  # APEX_O2


def train(cfg: ApexO2Config) -> dict:  # APEX_O2
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
    # >>> APEX_O2: fp32 master copies of the weights, cloned BEFORE the cast; then the model to fp16 except BatchNorm
    # (cast_o2), inputs to fp16 and outputs to fp32 (O2Forward); the optimizer steps the masters (docs/precision.md,
    # "The hand-written O2, step by step")
    amp = apex_amp_or_error() if cfg.precision == "apex-o2" else None
    if amp:  # apex-o2: apex does all of this itself, and keeps its masters and copies them back itself
        model, optimizer = amp.initialize(raw_model, build_optimizer(cfg, raw_model.parameters(), lr), opt_level="O2")
        model_params = master_params = []
    else:
        model_params = [p for p in raw_model.parameters() if p.requires_grad]
        master_params = [torch.nn.Parameter(p.detach().clone()) for p in model_params]
        model = O2Forward(cast_o2(raw_model))
        optimizer = build_optimizer(cfg, master_params, lr)
    # <<< APEX_O2
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    # >>> APEX_O2: no autocast (the model itself is fp16). apex's dynamic loss scale: 2**16 to start, halved after an
    # overflow, doubled after 2000 clean steps, at most 2**24 (--loss-scale-*). Checkpoints hold the fp32 masters
    # (O2Masters), not their rounded fp16 copy.
    autocast = autocast_for(cfg.precision, device)
    scaler = ApexScaler(amp) if amp else DynamicLossScaler(cfg.loss_scale_init, max_scale=cfg.loss_scale_max,
                                                           growth_interval=cfg.loss_scale_growth_interval)
    checkpointed = raw_model if amp else O2Masters(raw_model, model_params, master_params)
    # <<< APEX_O2
    criterion = build_loss(cfg, loss_fn)  # the mean cross-entropy, or yours (--loss: docs/your-model.md)

    def validate() -> tuple[float, float]:
        """The validation set's mean loss and accuracy: exact sums, one host sync (.item())."""
        loss_total, correct, count = evaluate(model, val_loader, device, autocast, cfg.eval_mode, criterion)
        return (loss_total / count).item(), (correct / count).item()

    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=checkpointed, optimizer=optimizer, scheduler=scheduler, scaler=scaler)  # APEX_O2: --resume loads these

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
                optimizer.zero_grad()  # APEX_O2: apex's patched zero_grad() takes no set_to_none (its default)
            # Accumulation: weight each micro-batch's mean loss by its share of the window's targets (labels, or
            # tokens of text), so the window's gradient is the mean over all its targets, as one big batch (also for
            # the epoch's last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            targets, window_targets = windows.count(micro_step)  # from the sampled indices (data.Windows)
            weight = targets / window_targets

            with autocast():  # forward and loss only: backward runs in the dtypes forward chose
                logits = model(x)
                loss = criterion(logits, y) * weight  # the micro-batch's share of the window's mean
            # >>> APEX_O2: the scaled loss's backward: fp16 gradients on the fp16 model, accumulating scaled over the
            # window
            if amp:  # apex-o2: apex's context scales; at the window's end it unscales into its masters, checks for inf
                with amp.scale_loss(loss, optimizer, delay_unscale=not window_end) as scaled_loss:
                    scaled_loss.backward()
            else:
                (loss * scaler.scale).backward()
            # <<< APEX_O2

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (keeping `loss` itself would keep the step's graph).
            losses.append(loss.detach())
            if cfg.train_acc:  # --no-train-acc: none (Lightning logs no train accuracy unless asked)
                predictions.append(logits.detach().argmax(-1)), labels.append(y)
            log_targets += targets
            samples_seen += x.shape[0]

            if window_end:
                # >>> APEX_O2: unscale into the masters: fp16 to fp32 THEN divided by the scale (in fp16 the division
                # could underflow); the model's gradients dropped. One host sync: any inf/NaN skips the step, as apex.
                # (apex-o2: both lists are empty; apex did all of this when its scale_loss context closed.)
                for p, master in zip(model_params, master_params):
                    master.grad = None if p.grad is None else p.grad.float().mul_(1.0 / scaler.scale)
                    p.grad = None
                grads = [m.grad for m in master_params if m.grad is not None]
                found_inf = bool(grads) and not torch.stack([g.isfinite().all() for g in grads]).all().item()
                # <<< APEX_O2
                if cfg.grad_clip:
                    # >>> APEX_O2: clip the fp32 masters' true (unscaled) gradients
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer) if amp else master_params,
                                                   cfg.grad_clip)
                    # <<< APEX_O2
                if cfg.grad_clip_value:  # every element into [-v, v]: the direction changes (norm clipping keeps it)
                    # >>> APEX_O2: the fp32 masters' gradients, as above
                    torch.nn.utils.clip_grad_value_(amp.master_params(optimizer) if amp else master_params,
                                                    cfg.grad_clip_value)
                    # <<< APEX_O2
                # >>> APEX_O2: step the fp32 masters and copy them into the fp16 model (copy_ rounds), unless a gradient
                # overflowed; then the scale: halved after an overflow, doubled after growth_interval clean steps
                if not found_inf:
                    optimizer.step()  # apex-o2: apex's patched step() skips itself after an overflow, copies back
                    with torch.no_grad():
                        for p, master in zip(model_params, master_params):
                            p.copy_(master)
                scaler.update(found_inf)
                # <<< APEX_O2
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
