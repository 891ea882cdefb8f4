# >>> HYBRID: the docstring shows this script's commands and what its diff teaches
"""Hybrid data + model parallelism: seq2seq split over two devices, and that split replicated (tag HYBRID).

    python launch/hybrid.py --mode dp-mp                              # one process (CPU: cpu,cpu,cpu,cpu)
    python launch/hybrid.py --mode dp-mp --devices cuda:0,cuda:1,cuda:2,cuda:3   # encoder on 0,1; decoder on 2,3
    torchrun --nproc_per_node=2 launch/hybrid.py --mode ddp-mp        # each rank: encoder on A, decoder on B
    torchrun --nproc_per_node=4 launch/hybrid.py --mode ddp-mp        # on 8 GPUs: rank r owns cuda:2r, cuda:2r+1

`diff manual_train/loops/single.py manual_train/loops/hybrid.py` is the lesson (docs/hybrid.md):
  --mode dp-mp ..... the source article's form, in one process: DataParallel(encoder, device_ids=group_a)
                     and DataParallel(decoder, device_ids=group_b), the activation moved from group_a[0]
                     to group_b[0] with .to(). (The article wraps the encoder twice; parallel.hybrid_dp_mp
                     wraps each half once.) --impl explicit runs the data parallelism written out, which
                     splits the batch on CPU too.
  --mode ddp-mp .... the modern form: one process per pair of devices (torchrun), the model split
                     across the pair as in launch/mp.py and wrapped in DDP without device_ids; each rank
                     reads its share of the sampler's permutation and DDP averages the gradients, so
                     N ranks with --batch-size b train the same weights as one process with N*b.
                     Evaluation is exact: disjoint shards, the three sums all-reduced.
"""
# <<< HYBRID
from __future__ import annotations

import contextlib  # HYBRID: nullcontext for the synced micro-step
import math
import time
# >>> HYBRID: the config subclass, rank 0's run folder, the process group and DDP
from dataclasses import dataclass
from pathlib import Path
# <<< HYBRID

import torch
# >>> HYBRID
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
# <<< HYBRID

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train.checkpoint import capture_rng  # HYBRID: ddp-mp saves every rank's RNG streams
from manual_train import parallel  # HYBRID: hybrid_dp_mp, split_encoder_decoder, device lists
from manual_train.config import Config, UsageError, arg  # HYBRID: HybridConfig's flags and their checks
from manual_train.distributed import DistEnv, read_env, setup, teardown  # HYBRID: torchrun's environment
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
# >>> HYBRID: launch/hybrid.py's defaults are mp.py's task and budget; device lists replace resolve_device
from manual_train.loops.model_parallel import DEFAULTS  # noqa: F401
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, seed_everything, set_deterministic
# <<< HYBRID

SCRIPT = "hybrid"  # HYBRID: runs/hybrid-<time>, summary.json's "script"


# >>> HYBRID: the script's own flags (docs/hybrid.md)
@dataclass
class HybridConfig(Config):
    """Config plus the mode, the device list and (dp-mp) the data-parallel implementation."""

    mode: str = arg("dp-mp", "dp-mp: one process, encoder data-parallel over the first half of --devices, "
                             "decoder over the second; ddp-mp: one process per device pair (torchrun), the split "
                             "model in DDP", choices=("dp-mp", "ddp-mp"))
    devices: str = arg("auto", "dp-mp: encoder group then decoder group, equal halves (auto: every GPU, else "
                               "cpu,cpu,cpu,cpu); ddp-mp: cpu,cpu for every rank, or two GPUs per local rank, rank r "
                               "taking entries 2r and 2r+1 (auto: cuda:2r,cuda:2r+1, else cpu,cpu)", metavar="LIST")
    impl: str = arg("torch", "dp-mp's data parallelism: torch (nn.DataParallel) or explicit (replicate/scatter/"
                             "parallel_apply/gather written out; splits the batch on CPU too)",
                    choices=("torch", "explicit"))

    def device_groups(self, env: DistEnv) -> tuple:
        """(group_a, group_b): the encoder's and the decoder's devices; under ddp-mp one each, this rank's pair."""
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.mode == "dp-mp":
            text = self.devices
            if text == "auto":
                text = parallel.cuda_list(n - n % 2) if n >= 2 else "cuda:0,cuda:0" if n == 1 else "cpu,cpu,cpu,cpu"
            names = parallel.parse_devices(text, "--devices", even=True, cuda_repeats=True, role="dp-mp",
                                           check_machine=False)  # the list first, then each group on this machine
            half = len(names) // 2
            return tuple(parallel.parse_devices(",".join(map(str, group)), "--devices", same_type=True,
                                                role="each dp-mp group") for group in (names[:half], names[half:]))
        text = self.devices
        if text == "auto":
            if n == 0:
                text = "cpu,cpu"
            elif n < 2 * env.local_world_size:
                raise UsageError("--devices", f"ddp-mp needs two GPUs per process: {env.local_world_size} local "
                                              f"rank(s) need {2 * env.local_world_size}, this node has {n}",
                                 "cpu,cpu, or fewer --nproc_per_node")
            else:
                text = parallel.cuda_list(2 * env.local_world_size)
        devices = parallel.parse_devices(text, "--devices", role="ddp-mp")
        if all(d.type == "cpu" for d in devices) and len(devices) == 2:
            return [devices[0]], [devices[1]]  # every rank on the one CPU
        if len(devices) != 2 * env.local_world_size:
            raise UsageError("--devices", f"{len(devices)} devices for {env.local_world_size} local rank(s); ddp-mp "
                                          "takes two per local rank", "cpu,cpu, or 2 x --nproc_per_node GPUs")
        return [devices[2 * env.local_rank]], [devices[2 * env.local_rank + 1]]

    def validate(self) -> None:
        super().validate()
        if self.model != "seq2seq":
            raise UsageError("--model", f"the hybrid splits seq2seq's encoder and decoder; {self.model} has no such "
                                        "halves", "seq2seq (with --dataset reverse)")
        if self.device != "auto":
            raise UsageError("--device", "hybrid.py places the model with --devices, not --device", "auto")
        env = read_env()
        if self.mode == "dp-mp" and env.world_size > 1:
            raise UsageError("--mode", "dp-mp is one process driving every device; under torchrun use ddp-mp",
                             "ddp-mp")
        if self.mode == "ddp-mp" and self.impl != "torch":
            raise UsageError("--impl", "ddp-mp's data parallelism is DDP; --impl chooses dp-mp's", "torch")
        group_a, group_b = self.device_groups(env)
        if self.mode == "dp-mp" and self.impl == "torch" and torch.cuda.is_available() and \
                "cpu" in {group_a[0].type, group_b[0].type}:
            raise UsageError("--devices", "nn.DataParallel takes only CUDA devices when CUDA is available",
                             "cuda:N lists, or --impl explicit for cpu lists")
        if self.precision not in ("32-true", "64-true") and group_a[0].type != group_b[0].type:
            raise UsageError("--precision", f"{self.precision} autocasts one device type; the encoder's "
                                            f"{group_a[0]} and the decoder's {group_b[0]} differ", "32-true")
        if self.batch_size < max(len(group_a), len(group_b)):
            raise UsageError("--batch-size", f"{self.batch_size} cannot be split over {len(group_a)} devices",
                             f">= {len(group_a)}")


def train(cfg: Config) -> dict:
    """dp-mp is one process. ddp-mp joins the process group first and leaves it on every exit path (a rank that
    leaves without destroy_process_group can leave the others' collectives hanging)."""
    env = read_env()
    if cfg.mode != "ddp-mp":
        return train_rank(cfg, env)
    group_a, _ = cfg.device_groups(env)
    # gloo or nccl (plain python: a group of one), not bound to one GPU: DDP and the sums use both of the pair's
    setup(env, group_a[0], bind_device=False)
    try:
        return train_rank(cfg, env)
    finally:
        teardown()


def train_rank(cfg: Config, env: DistEnv) -> dict:
    # <<< HYBRID
    # ------------------------------------------------------------------ setup
    # >>> HYBRID: the encoder's devices (group_a) and the decoder's (group_b); the logits, the loss, the running sums
    # and evaluation live on group_b[0], which is `device` from here on. One flag gates every rank-0 side effect.
    group_a, group_b = cfg.device_groups(env)
    device = group_b[0]
    rank, world_size, master_process = env.rank, env.world_size, env.master_process
    # <<< HYBRID
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    train_ds, val_ds, info = data.build_datasets(cfg)
    # >>> HYBRID: rank r reads perm[r::world_size] of the one permutation, and its own disjoint validation shard
    sampler = data.train_sampler(train_ds, cfg.seed, world_size, rank)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, world_size, rank), cfg, device,
                                   batch_size=cfg.eval_batch_size)
    n_train = len(sampler)  # this rank's samples per epoch
    global_batch_size = cfg.batch_size * cfg.accumulate * world_size
    # <<< HYBRID
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
    # >>> HYBRID: moved once: the encoder to group_a[0], the decoder to group_b[0]. dp-mp wraps each half in its
    # own DataParallel; ddp-mp splits the model over this rank's pair. Either holds raw_model's own submodules.
    if cfg.mode == "dp-mp":
        split = parallel.hybrid_dp_mp(raw_model, group_a, group_b, cfg.impl)
    else:
        split = parallel.split_encoder_decoder(raw_model, [group_a[0], group_b[0]])
    # <<< HYBRID
    amp = Precision(cfg, device)
    model, params = amp.prepare(split)  # HYBRID: the split model is what the loop calls (16-o2: cast in place)
    optimizer = build_optimizer(cfg, params, lr)
    model, optimizer = amp.apex_initialize(model, optimizer)  # apex-o2 only
    params = [p for group in optimizer.param_groups for p in group["params"]]  # what clipping sees
    # >>> HYBRID: ddp-mp: DDP over the split model, without device_ids: the module spans two devices, so DDP
    # must not move inputs or outputs. It broadcasts rank 0's weights now, and in backward all-reduces (averages)
    # the gradients in buckets, per device, while the rest of backward still runs. Evaluation calls the
    # unwrapped module: no collective can then wait on a rank whose validation shard is shorter.
    eval_model = model
    if cfg.mode == "ddp-mp":
        model = DDP(model)
        seed_everything(cfg.seed + rank)  # the weights are equal now; each rank draws its own random numbers
    # <<< HYBRID
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    early = EarlyStopping(cfg.monitor, cfg.early_stop_patience, cfg.early_stop_min_delta)
    start_epoch, skip_micro_steps, step, samples_seen, best = resume_point(ckpt)
    if ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        amp.load_state_dict(ckpt["scaler"])
        early.load_state_dict(ckpt["early_stopping"])
        # >>> HYBRID: last: this rank's own streams, so every draw from here on repeats the uninterrupted run's
        # (a checkpoint of another world size holds rank 0's streams only: every rank takes those)
        per_rank = ckpt.get("rng_per_rank", [])
        restore_rng(per_rank[rank] if len(per_rank) == world_size else ckpt["rng"])
        # <<< HYBRID

    out_dir = cfg.run_dir(SCRIPT)
    # >>> HYBRID: every rank takes rank 0's folder (default names carry a timestamp); rank 0 alone writes to it
    if world_size > 1:
        shared = [str(out_dir)]
        dist.broadcast_object_list(shared, src=0)
        cfg.out_dir, out_dir = shared[0], Path(shared[0])
    log = RunLog(out_dir, enabled=master_process, tensorboard=cfg.tensorboard, resume_step=step if ckpt else None)
    banner(log, script=SCRIPT, device=device, cfg=cfg, raw_model=raw_model, train_ds=train_ds, val_ds=val_ds,
           global_batch_size=global_batch_size, world_size=world_size, lr=lr, total_steps=total_steps,
           out_dir=out_dir, resumed_from=resume if ckpt else None, start_epoch=start_epoch, step=step)
    log.print(f"hybrid {cfg.mode}: encoder on {','.join(map(str, group_a))}, decoder on "
              f"{','.join(map(str, group_b))}" + (f" (rank 0 of {world_size}; each rank its own pair)"
                                                  if cfg.mode == "ddp-mp" else f", data parallel: {cfg.impl}"))
    if cfg.mode == "dp-mp" and cfg.impl == "torch" and not torch.cuda.is_available():
        log.print("no CUDA here: nn.DataParallel ignores device_ids and calls each half directly (the seq2seq "
                  "baseline, split); --impl explicit splits each half's batch on CPU")
    # <<< HYBRID

    # ------------------------------------------------------------------ training loop
    progress = progress_bar(total_steps, step, enabled=cfg.progress and master_process)  # HYBRID: rank 0 draws
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
            # >>> HYBRID: x stays on the host: the split model sends its rows to each half's device (and scatters them)
            y = y.to(device, non_blocking=True)  # the targets go where the logits come out
            # <<< HYBRID
            window_start = micro_step % cfg.accumulate == 0
            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == len(train_loader)
            if window_start:
                optimizer.zero_grad(set_to_none=True)  # gradients accumulate over the window's micro-batches
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)

            # >>> HYBRID: ddp-mp all-reduces gradients only on a window's last micro-batch. DDP decides in forward
            # whether this backward syncs; under no_sync() the gradients just accumulate locally.
            sync = model.no_sync() if cfg.mode == "ddp-mp" and not window_end else contextlib.nullcontext()
            # <<< HYBRID
            with amp.autocast(), sync:  # HYBRID: forward and loss, under no_sync on non-final micro-steps
                logits = model(x)
                loss = loss_fn(logits, y)
            amp.backward(loss * weight, optimizer, window_end)  # scaled backward under 16-mixed / O2

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (summing `loss` itself would chain every step's graph).
            loss_sum += loss.detach() * weight
            correct_sum += correct_count(logits.detach(), y)
            log_samples += x.shape[0]
            log_targets += y.numel()
            samples_seen += x.shape[0] * world_size  # HYBRID: every rank reads an equal share (the sampler pads)
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
                    # >>> HYBRID: log the global numbers: one all-reduce per log row. Every rank then holds the same
                    # loss, so a NaN stops all of them at the same step.
                    if world_size > 1:
                        totals = torch.stack([loss_sum, correct_sum])
                        dist.all_reduce(totals)
                        loss_sum.copy_(totals[0] / world_size), correct_sum.copy_(totals[1])
                        log_samples, log_targets = log_samples * world_size, log_targets * world_size
                    # <<< HYBRID
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
            # >>> HYBRID: each rank evaluates its own disjoint shard with the unwrapped module; the summed sums are the
            # full set's, exactly, and every rank gets the same numbers (and early-stopping decisions)
            loss_total, correct, count = evaluate(eval_model, val_loader, device, amp, cfg.eval_mode)
            if world_size > 1:
                for total in (loss_total, correct, count):
                    dist.all_reduce(total)
            # <<< HYBRID
            val_loss, val_acc = (loss_total / count).item(), (correct / count).item()  # host sync, once per eval
            improved = early.update(val_loss if cfg.monitor == "val_loss" else val_acc, epoch)
            best = {"val_loss": min(val_loss, best.get("val_loss", math.inf)),
                    "val_acc": max(val_acc, best.get("val_acc", -math.inf)), "epoch": early.best_epoch}
            log.row(step=step, epoch=epoch, split="val", loss=val_loss, acc=val_acc,
                    lr=scheduler.get_last_lr()[0], samples_per_s=0.0, time_s=time.perf_counter() - t_start)
            log.print(f"epoch {epoch + 1}/{num_epochs} step {step}: val_loss {val_loss:.4f} "
                      f"val_acc {val_acc:.4f}" + (" (best)" if improved else ""))
        # >>> HYBRID: every rank's RNG streams (a collective: all ranks send), saved by rank 0
        rng_per_rank = [capture_rng()]
        if world_size > 1:
            rng_per_rank = [None] * world_size
            dist.all_gather_object(rng_per_rank, capture_rng())
        # <<< HYBRID
        checkpoint = build_checkpoint(
            model_state=amp.model_state_dict(raw_model), optimizer_state=optimizer.state_dict(),
            scheduler=scheduler, amp=amp, early_stopping=early, cfg=cfg, world_size=world_size,  # HYBRID: N ranks
            epoch=epoch + 1 if epoch_done else epoch, micro_steps_done=0 if epoch_done else micro_steps_done,
            step=step, samples_seen=samples_seen, best=best, rng_per_rank=rng_per_rank)  # HYBRID: and RNGs
        # >>> HYBRID: rank 0 alone writes (every rank holds the same weights); the barrier holds every rank until
        # last.pt is on disk, so a crash anywhere in the next epoch can resume from this epoch's end
        if master_process:
            save_checkpoint(checkpoint, out_dir / "last.pt")  # every epoch, atomically
            if improved:
                save_checkpoint(checkpoint, out_dir / "best.pt")
        if world_size > 1:
            dist.barrier()
        # <<< HYBRID
        if early.should_stop:
            log.print(f"early stop: {early.reason}")
            break
        if step == total_steps:
            break

    # ------------------------------------------------------------------ teardown
    progress.close()
    wall_s = time.perf_counter() - t_start
    # >>> HYBRID: every rank must take the same branch (it all-reduces), so rank 0 says whether best.pt exists
    best_exists = [(out_dir / "best.pt").exists()]
    if world_size > 1:
        dist.broadcast_object_list(best_exists, src=0)
    if cfg.restore_best and best_exists[0]:
        amp.load_model_state_dict(raw_model, load_checkpoint(out_dir / "best.pt")["model"])
        loss_total, correct, count = evaluate(eval_model, val_loader, device, amp, cfg.eval_mode)
        if world_size > 1:
            for total in (loss_total, correct, count):
                dist.all_reduce(total)
        # <<< HYBRID
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
        log.print(f"restored best weights (epoch {early.best_epoch + 1}): "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
    summary = run_summary(
        # >>> HYBRID
        script=SCRIPT, world_size=world_size, device=device, cfg=cfg, global_batch_size=global_batch_size, epoch=epoch,
        # <<< HYBRID
        step=step, samples_seen=samples_seen, samples_this_run=samples_seen - samples_at_start, val_loss=val_loss,
        val_acc=val_acc, best=best, early=early, amp=amp, wall_s=wall_s, data_wait_s=data_wait_s,
        # >>> HYBRID: rank 0's devices (each rank of ddp-mp has its own pair)
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr,
        mode=cfg.mode, impl=cfg.impl, encoder_devices=[str(d) for d in group_a],
        decoder_devices=[str(d) for d in group_b],
        peak_mem_bytes_per_device={str(d): peak_mem_bytes(d) for d in dict.fromkeys(group_a + group_b)})
        # <<< HYBRID
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
