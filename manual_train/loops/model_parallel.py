# >>> MP: the docstring shows this script's commands and what its diff teaches
"""Model parallelism: the seq2seq encoder on one device, the decoder on another (tag MP).

    python launch/mp.py                                   # reverse digits: >= 0.9 token accuracy on 2 CPU cores
    python launch/mp.py --devices cuda:0,cuda:1           # encoder on GPU 0, decoder on GPU 1
    python launch/mp.py --devices cuda:0,cuda:1 --microbatches 4   # GPipe fill-drain over 4 micro-batches
    python launch/mp.py --resume runs/mp-<time>/last.pt --epochs 4

`diff manual_train/loops/single.py manual_train/loops/model_parallel.py` is the lesson (docs/model_parallel.md):
  parallel.split_encoder_decoder(raw_model, [A, B]) moves the encoder to A and the decoder to B and
  returns a module whose forward moves the one activation that crosses (the encoder's hidden state)
  with .to(B); the logits come out on B, where the targets go and the loss is computed. Backward
  crosses back by itself: autograd records the .to() and sends the gradient to A.
  --microbatches M cuts each batch into M micro-batches and runs them on GPipe's fill-drain schedule,
  so that B can decode one micro-batch while A encodes the next; each device then idles for
  (S-1)/(M+S-1) of the step instead of half of it (S = 2 stages). The gradient is the full batch's.
On CPU (`--devices cpu,cpu`) both stages share the same cores: the code path and the arithmetic are
the GPU ones, the overlap is not. Modern form: torch.distributed.pipelining (docs/model_parallel.md).
"""
# <<< MP
from __future__ import annotations

import math
import time
from dataclasses import dataclass  # MP: the config subclass

import torch

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train import parallel  # MP: split_encoder_decoder, the fill-drain schedule, device lists
from manual_train.config import Config, UsageError, arg  # MP: MPConfig's flags and their checks
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
# >>> MP: the device list replaces resolve_device
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, seed_everything, set_deterministic
# <<< MP

SCRIPT = "mp"  # MP: runs/mp-<time>, summary.json's "script"


# >>> MP: the script's own flags and defaults (docs/model_parallel.md)
# launch/mp.py's defaults: the reverse task with a budget that reaches >= 0.9 token accuracy on CPU
# (more samples rather than more epochs: with 2048 samples the GRU overfits near 0.85).
DEFAULTS = dict(dataset="reverse", model="seq2seq", optimizer="adamw", lr=3e-3, epochs=2, synthetic_size=16384)


@dataclass
class MPConfig(Config):
    """Config plus the two devices and the number of pipelined micro-batches."""

    devices: str = arg("auto", "encoder device,decoder device (auto: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 "
                               "with one, else cpu,cpu)", metavar="A,B")
    microbatches: int = arg(1, "micro-batches per batch, pipelined fill-drain (GPipe); 1 = naive model "
                               "parallelism", min=1)

    def device_list(self) -> list:
        text = self.devices
        if text == "auto":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            text = "cuda:0,cuda:1" if n >= 2 else "cuda:0,cuda:0" if n == 1 else "cpu,cpu"
        return parallel.parse_devices(text, "--devices", count=2, cuda_repeats=True,
                                      role="model parallelism (encoder device, decoder device)")

    def validate(self) -> None:
        super().validate()
        if self.model != "seq2seq":
            raise UsageError("--model", f"model parallelism splits seq2seq's encoder and decoder; {self.model} has "
                                        "no such halves", "seq2seq (with --dataset reverse)")
        if self.device != "auto":
            raise UsageError("--device", "mp.py places the model with --devices, not --device", "auto")
        devices = self.device_list()
        if self.precision not in ("32-true", "64-true") and devices[0].type != devices[1].type:
            raise UsageError("--precision", f"{self.precision} autocasts one device type; {devices[0]} and "
                                            f"{devices[1]} differ", "32-true, or two devices of one kind")
        if self.microbatches > self.batch_size:
            raise UsageError("--microbatches", f"{self.microbatches} micro-batches cannot be cut from a batch of "
                                               f"{self.batch_size}", f"<= --batch-size ({self.batch_size})")
# <<< MP


def train(cfg: Config) -> dict:
    # ------------------------------------------------------------------ setup
    # >>> MP: the encoder's device A and the decoder's device B; the logits, the loss, the running sums and
    # evaluation live on B, which is `device` from here on.
    devices = cfg.device_list()
    device = devices[1]
    # <<< MP
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
    # >>> MP: moved once: the encoder to A, the decoder to B. `split` holds raw_model's own submodules (no copy),
    # so the optimizer, precision and checkpoints all see raw_model's parameters.
    split = parallel.split_encoder_decoder(raw_model, devices, cfg.microbatches)
    # <<< MP
    amp = Precision(cfg, device)
    model, params = amp.prepare(split)  # MP: the split model is what the loop calls (16-o2: cast in place)
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
    # >>> MP: where each half runs and what the pipeline leaves idle
    sizes = [len(c) for c in torch.arange(cfg.batch_size).chunk(cfg.microbatches)]
    log.print(f"model parallel: encoder on {devices[0]}, decoder on {devices[1]}; {len(sizes)} micro-batch(es) "
              f"of {sizes}; fill-drain bubble (S-1)/(M+S-1) = {parallel.bubble_fraction(2, len(sizes)):.2f}")
    # <<< MP

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
            # >>> MP: x stays on the host: the split model sends its source row to A and its decoder row to B.
            y = y.to(device, non_blocking=True)  # the targets go to B, where the logits come out
            # <<< MP
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
        # >>> MP: each device holds half the parameters and their optimizer state
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr,
        devices=[str(d) for d in devices], microbatches=cfg.microbatches,
        bubble_fraction=parallel.bubble_fraction(2, min(cfg.microbatches, cfg.batch_size)),
        peak_mem_bytes_per_device={str(d): peak_mem_bytes(d) for d in dict.fromkeys(devices)})
        # <<< MP
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
