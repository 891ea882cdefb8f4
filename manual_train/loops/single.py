"""Single-device training: the baseline every other loop in manual_train is a diff of.

    python launch/single.py                                 # cnn on digits, >= 0.95 val acc, ~20 s on 2 CPU cores
    python launch/single.py --batch-size 16 --accumulate 4  # the same weights as --batch-size 64
    python launch/single.py --precision bf16-mixed --num-workers 2 --pin-memory
    python launch/single.py --resume runs/single-<time>/last.pt --epochs 12

Reads top to bottom: setup, the loop, teardown. The techniques are the commented lines:
  DataLoader tuning ........ data.build_loader (workers, pinning, prefetch) and .to(non_blocking=True)
  gradient accumulation .... micro-batch loss weights, zero_grad at window start, one step per window
  precision ................ amp.autocast / amp.backward / amp.unscale_ / amp.step (manual_train/precision.py)
  logging .................. running sums of loss.detach() on the device, .item() only at log steps
  evaluation ............... evaluation.evaluate under no_grad or inference_mode, exact sums
  early stopping, checkpoints and exact resume (early_stopping.py, checkpoint.py)
"""
from __future__ import annotations

import math
import time

import torch

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train.config import Config
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, resolve_device, seed_everything, set_deterministic

SCRIPT = "single"


def train(cfg: Config) -> dict:
    # ------------------------------------------------------------------ setup
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    train_ds, val_ds, info = data.build_datasets(cfg)
    sampler = data.train_sampler(train_ds, cfg.seed)  # DistributedSampler's order at world size 1
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(val_ds, cfg, device, batch_size=cfg.eval_batch_size)
    n_train = len(sampler)
    global_batch_size = cfg.batch_size * cfg.accumulate
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
    if ckpt:
        raw_model.load_state_dict(ckpt["model"])  # fp32 (64-true: fp64) weights, before any O2 cast
    raw_model.to(device)  # moved once; nothing in the loop moves parameters again
    amp = Precision(cfg, device)
    model, params = amp.prepare(raw_model)  # 16-o2: fp16 model, fp32 master params for the optimizer
    optimizer = build_optimizer(cfg, params, lr)
    model, optimizer = amp.apex_initialize(model, optimizer)  # apex-o2 only
    params = [p for group in optimizer.param_groups for p in group["params"]]  # what clipping sees
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    early = EarlyStopping(cfg.monitor, cfg.early_stop_patience, cfg.early_stop_min_delta)
    start_epoch, skip_micro_steps, step, samples_seen, best = resume_point(ckpt)
    if ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        amp.load_state_dict(ckpt["scaler"])
        early.load_state_dict(ckpt["early_stopping"])
        restore_rng(ckpt["rng"])  # last: every draw from here on repeats the uninterrupted run's

    out_dir = cfg.run_dir(SCRIPT)
    log = RunLog(out_dir, tensorboard=cfg.tensorboard, resume_step=step if ckpt else None)
    banner(log, script=SCRIPT, device=device, cfg=cfg, raw_model=raw_model, train_ds=train_ds, val_ds=val_ds,
           global_batch_size=global_batch_size, world_size=1, lr=lr, total_steps=total_steps, out_dir=out_dir,
           resumed_from=resume if ckpt else None, start_epoch=start_epoch, step=step)

    # ------------------------------------------------------------------ training loop
    progress = progress_bar(total_steps, step, enabled=cfg.progress)
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

            with amp.autocast():  # forward and loss only; a no-op context for 32-true and O2
                logits = model(x)
                loss = loss_fn(logits, y)
            amp.backward(loss * weight, optimizer, window_end)  # scaled backward under 16-mixed / O2

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (summing `loss` itself would chain every step's graph).
            loss_sum += loss.detach() * weight
            correct_sum += correct_count(logits.detach(), y)
            log_samples += x.shape[0]
            log_targets += y.numel()
            samples_seen += x.shape[0]
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
                    # .item() is a host sync: it waits for every queued kernel. Here once per log row.
                    train_loss = (loss_sum / log_steps).item()
                    train_acc = correct_sum.item() / log_targets
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
            loss_total, correct, count = evaluate(model, val_loader, device, amp, cfg.eval_mode)
            val_loss, val_acc = (loss_total / count).item(), (correct / count).item()  # host sync, once per eval
            improved = early.update(val_loss if cfg.monitor == "val_loss" else val_acc, epoch)
            best = {"val_loss": min(val_loss, best.get("val_loss", math.inf)),
                    "val_acc": max(val_acc, best.get("val_acc", -math.inf)), "epoch": early.best_epoch}
            log.row(step=step, epoch=epoch, split="val", loss=val_loss, acc=val_acc,
                    lr=scheduler.get_last_lr()[0], samples_per_s=0.0, time_s=time.perf_counter() - t_start)
            log.print(f"epoch {epoch + 1}/{num_epochs} step {step}: val_loss {val_loss:.4f} "
                      f"val_acc {val_acc:.4f}" + (" (best)" if improved else ""))
        checkpoint = build_checkpoint(
            model_state=amp.model_state_dict(raw_model), optimizer_state=optimizer.state_dict(),
            scheduler=scheduler, amp=amp, early_stopping=early, cfg=cfg, world_size=1,
            epoch=epoch + 1 if epoch_done else epoch, micro_steps_done=0 if epoch_done else micro_steps_done,
            step=step, samples_seen=samples_seen, best=best)
        save_checkpoint(checkpoint, out_dir / "last.pt")  # every epoch, atomically
        if improved:
            save_checkpoint(checkpoint, out_dir / "best.pt")
        if early.should_stop:
            log.print(f"early stop: {early.reason}")
            break
        if step == total_steps:
            break

    # ------------------------------------------------------------------ teardown
    progress.close()
    wall_s = time.perf_counter() - t_start
    if cfg.restore_best and (out_dir / "best.pt").exists():
        amp.load_model_state_dict(raw_model, load_checkpoint(out_dir / "best.pt")["model"])
        loss_total, correct, count = evaluate(model, val_loader, device, amp, cfg.eval_mode)
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
        log.print(f"restored best weights (epoch {early.best_epoch + 1}): "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
    summary = run_summary(
        script=SCRIPT, world_size=1, device=device, cfg=cfg, global_batch_size=global_batch_size, epoch=epoch,
        step=step, samples_seen=samples_seen, samples_this_run=samples_seen - samples_at_start, val_loss=val_loss,
        val_acc=val_acc, best=best, early=early, amp=amp, wall_s=wall_s, data_wait_s=data_wait_s,
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr)
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
