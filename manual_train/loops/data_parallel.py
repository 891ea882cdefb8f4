# >>> DP: the docstring shows this script's commands and what its diff teaches
"""Data parallelism in one process: nn.DataParallel, and what it does written out (tag DP).

    python launch/dp.py                                      # nn.DataParallel over every GPU (CPU: see below)
    python launch/dp.py --impl explicit --devices cpu,cpu    # replicate/scatter/parallel_apply/gather on CPU
    python launch/dp.py --devices cuda:0,cuda:1 --output-device cuda:1
    python launch/dp.py --resume runs/dp-<time>/last.pt --epochs 12

`diff manual_train/loops/single.py manual_train/loops/data_parallel.py` is the lesson (docs/data_parallel.md):
  --impl torch ........ nn.DataParallel(model, device_ids=[...], output_device=...). (The source article
                        writes `devices=`, which is not an argument of DataParallel.) On a host without
                        CUDA, DataParallel ignores device_ids and calls the module: the baseline.
  --impl explicit ..... one forward of DataParallel written out: replicate the module to every device,
                        scatter the batch, parallel_apply, gather the outputs on --output-device; the
                        loss is computed there on the full batch, and backward sends the gradients back
                        through the gather and the replication into the original parameters.
One process drives every device: the batch is split, not multiplied (global batch = --batch-size).
DDP (launch/ddp.py, one process per device) replaced this; Lightning removed strategy='dp' in 2.0.
"""
# <<< DP
from __future__ import annotations

import math
import time
# >>> DP: the config subclass
from dataclasses import dataclass
from typing import Optional
# <<< DP

import torch

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train import parallel  # DP: replicate, scatter, parallel_apply, gather; device lists
from manual_train.config import Config, UsageError, arg  # DP: DPConfig's flags and their checks
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
# >>> DP: the device list replaces resolve_device
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, seed_everything, set_deterministic
# <<< DP

SCRIPT = "dp"  # DP: runs/dp-<time>, summary.json's "script"


# >>> DP: the script's own flags (docs/data_parallel.md)
@dataclass
class DPConfig(Config):
    """Config plus the device list, the implementation and the device that gathers the outputs."""

    devices: str = arg("auto", "devices each batch is split over: cpu,cpu,... or cuda:0,cuda:1,... "
                               "(auto: every visible GPU, else cpu,cpu)", metavar="LIST")
    impl: str = arg("torch", "torch: nn.DataParallel; explicit: its replicate/scatter/parallel_apply/gather "
                             "written out (splits the batch on CPU too)", choices=("torch", "explicit"))
    output_device: Optional[str] = arg(None, "where outputs are gathered and the loss is computed "
                                             "(default: the first of --devices)", metavar="DEVICE")

    def device_list(self) -> list:
        text = self.devices
        if text == "auto":
            text = parallel.cuda_list(torch.cuda.device_count()) if torch.cuda.is_available() else "cpu,cpu"
        return parallel.parse_devices(text, "--devices", same_type=True, role="data parallelism")

    def gather_device(self) -> torch.device:
        devices = self.device_list()
        if self.output_device is None:
            return devices[0]
        out = parallel.parse_devices(self.output_device, "--output-device", count=1, role="--output-device")[0]
        if out.type != devices[0].type:
            raise UsageError("--output-device", f"{out} is not a {devices[0].type} device like --devices",
                             ", ".join(sorted({str(d) for d in devices})))
        return out

    def validate(self) -> None:
        super().validate()
        if self.device != "auto":
            raise UsageError("--device", "dp.py places the model with --devices, not --device", "auto")
        devices = self.device_list()
        if self.impl == "torch" and devices[0].type == "cpu" and torch.cuda.is_available():
            raise UsageError("--devices", "nn.DataParallel takes only CUDA devices when CUDA is available",
                             "cuda:N lists, or --impl explicit for cpu lists")
        self.gather_device()
        if self.batch_size < len(devices):
            raise UsageError("--batch-size", f"{self.batch_size} cannot be split over {len(devices)} devices",
                             f">= {len(devices)}")
# <<< DP


def train(cfg: Config) -> dict:


    # ------------------------------------------------------------------ setup
    # >>> DP: the model lives on devices[0] (DataParallel replicates from there); the outputs, the loss, the
    # running sums and evaluation live on the output device, which is `device` from here on.
    devices = cfg.device_list()
    device = cfg.gather_device()
    # <<< DP
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
    raw_model.to(devices[0])  # DP: moved once to devices[0]; replicas are copied from it at every forward
    amp = Precision(cfg, device)
    model, params = amp.prepare(raw_model)  # 16-o2: fp16 model, fp32 master params for the optimizer
    optimizer = build_optimizer(cfg, params, lr)
    model, optimizer = amp.apex_initialize(model, optimizer)  # apex-o2 only
    # >>> DP: --impl torch trains through nn.DataParallel; --impl explicit writes its forward out in the loop
    # below and evaluates through the same four steps packaged as a module.
    module = model  # what is replicated: the model as precision prepared it (O2: in its fp16 wrapper)
    model = parallel.data_parallel(module, devices, device, cfg.impl)
    # <<< DP
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
    # >>> DP: say what the split is; on a host without CUDA nn.DataParallel is the plain module
    sizes = [len(c) for c in torch.arange(cfg.batch_size).chunk(len(devices))]
    if cfg.impl == "torch" and not torch.cuda.is_available():
        log.print(f"no CUDA here: nn.DataParallel ignores device_ids and calls the module directly, so each batch "
                  f"of {cfg.batch_size} runs whole on {device} (the single-device baseline); --impl explicit "
                  f"splits it into chunks of {sizes} on the CPU")
    else:
        log.print(f"{cfg.impl} data parallel over {','.join(map(str, devices))}: each batch of {cfg.batch_size} "
                  f"splits into chunks of {sizes}; outputs gathered and loss computed on {device}")
    # <<< DP

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
            # >>> DP: x stays on the host, scatter copies each chunk to its own device; targets go where outputs are
            y = y.to(device, non_blocking=True)
            # <<< DP
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == len(train_loader)
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)

            with amp.autocast():  # forward and loss only; a no-op context for 32-true and O2
                # >>> DP: one forward of nn.DataParallel; --impl explicit spells it out
                if cfg.impl == "explicit" and len(devices) > 1:
                    chunks = parallel.scatter((x,), devices)  # B samples -> chunks of ceil(B/n) along dim 0
                    replicas = parallel.replicate(module, devices[: len(chunks)])  # every step: a copy per device
                    outputs = parallel.parallel_apply(replicas, chunks, devices)  # CUDA: one thread per device
                    logits = parallel.gather(outputs, device)  # the whole batch's outputs on one device
                else:
                    logits = model(x)
                # One loss over the gathered batch, as DataParallel does: its gradient is the full batch's mean.
                # (Averaging per-chunk mean losses is wrong when chunks differ in size; summing them makes the
                # gradient about n times too large; tests/test_dp.py::test_per_chunk_losses_need_weighting.)
                loss = loss_fn(logits, y)
                # <<< DP
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
        # >>> DP: per-device peaks show the imbalance on the output device (on CPU: one process, one number)
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr,
        impl=cfg.impl, devices=[str(d) for d in devices],
        peak_mem_bytes_per_device={str(d): peak_mem_bytes(d) for d in dict.fromkeys(devices + [device])})
        # <<< DP
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
