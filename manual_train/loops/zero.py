# >>> ZERO: the docstring: what each stage shards, the commands, and what differs from the DDP loop
"""ZeRO under torchrun: DDP whose ranks split the optimizer state (stage 1), gradients (2) and parameters (3).

    torchrun --nproc_per_node=4 launch/zero.py --stage 2        # 4 CPU ranks (gloo), FSDP2, >= 0.95 val acc on digits
    torchrun --nproc_per_node=2 launch/zero.py --stage 1 --impl fairscale   # fairscale's OSS + DDP
    torchrun --nproc_per_node=2 launch/zero.py --stage 3 --optimizer adamw --epochs 1 --out-dir Z   # the weights of:
    torchrun --nproc_per_node=2 launch/ddp.py --optimizer adamw --epochs 1 --out-dir D              #   (1e-6)
    torchrun --nproc_per_node=8 launch/zero.py --stage 3 --device cuda --precision bf16-mixed --batch-size 32
    python launch/single.py --resume Z/last.pt --epochs 2      # a ZeRO checkpoint is a plain one

    --impl    stage 1                         stage 2                              stage 3
    torch     ZeroRedundancyOptimizer + DDP   FSDP2, reshard_after_forward=False   FSDP2, reshard_after_forward=True
    fairscale OSS + DDP                       OSS + ShardedDataParallel            FullyShardedDataParallel (CUDA only)

Per rank, with N ranks and psi parameters (fp32 AdamW: 4 + 4 + 8 bytes per parameter), the ZeRO paper's model:
DDP (4+4+8) psi; stage 1 (4+4) psi + 8 psi/N; stage 2 4 psi + (4+8) psi/N; stage 3 (4+4+8) psi/N. The run measures
what each rank really holds and prints it next to these at the end (summary.json: per_rank_bytes).

`diff manual_train/loops/ddp.py manual_train/loops/zero.py` is the lesson; every changed line is marked ZERO, the
functions it calls are in manual_train/zero.py:
  the model ........ shard(): the wrapper and the sharded optimizer for --impl and --stage, built around the
                     baseline's model and optimizer (FSDP2: per block, then the root)
  the step ......... zero_grad (ShardedDDP's own), no_sync (none under FSDP: gradients stay sharded),
                     clip_grad_norm over the shards, a shard-aware loss scaler for 16-mixed
  evaluation ....... FSDP's forward is a collective: every rank runs the same number of batches
  checkpoints ...... every rank joins in gathering the full model and optimizer state; rank 0 writes a plain
                     checkpoint (single.py and ddp.py resume it; this loop resumes theirs)
  the end .......... bytes of parameters, gradients and optimizer state held by each rank, against the formulas
Defaults are the DDP loop's (--batch-size 8 per rank); --impl torch is the default: it runs every stage on the CPU
and on GPUs, ships with torch, and is maintained (fairscale's last release was 0.4.13 in 2022).
"""
# <<< ZERO
from __future__ import annotations

import math
# >>> ZERO: what ZeroConfig needs (the DDP loop's os, signal and nullcontext served code imported from it below)
from dataclasses import dataclass
from typing import Optional
# <<< ZERO
import time

import torch
# >>> DDP
import torch.distributed as dist
import torch.nn as nn
# >>> ZERO: no DistributedDataParallel import: shard() (manual_train/zero.py) builds the wrapper
# <<< ZERO
# <<< DDP

from manual_train import data
from manual_train.checkpoint import (build_checkpoint, check_compatible, load_checkpoint, restore_rng,
                                     resume_point, save_checkpoint)
from manual_train.checkpoint import capture_rng  # DDP: every rank's RNG streams go into the checkpoint
from manual_train.config import Config, arg  # ZERO: ZeroConfig raises no UsageError itself (check_zero does)
from manual_train.distributed import DistEnv, pick_device, read_env, setup, teardown  # DDP
# >>> ZERO: the DDP loop's config, defaults and fault injection; the sharding functions
from manual_train.loops.ddp import DEFAULTS, DDPConfig  # noqa: F401 (DEFAULTS: launch/zero.py)
from manual_train.zero import (IMPLS, STAGES, check_zero, clip_grad_norm, eval_module, format_table,
                               full_model_state_dict, full_optimizer_state_dict, load_full_model_state_dict,
                               load_optimizer_state_dict, no_sync, per_rank_bytes, reshard, same_batch_count, shard,
                               shard_aware_scaler, state_bytes_per_param, zero_formula_bytes, zero_grad)
# <<< ZERO
from manual_train.early_stopping import EarlyStopping
from manual_train.evaluation import evaluate
from manual_train.metrics import RunLog, banner, progress_bar, run_summary
from manual_train.models import build_model, correct_count, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.precision import Precision, param_dtype
# >>> DDP: pick_device (manual_train.distributed) chooses the device instead of resolve_device
from manual_train.runtime import TrainingDiverged, peak_mem_bytes, seed_everything, set_deterministic
# <<< DDP

SCRIPT = "zero"  # ZERO


# >>> ZERO: the flags this script adds to the DDP loop's (whose defaults it keeps: DEFAULTS, imported above)
@dataclass
class ZeroConfig(DDPConfig):
    """The DDP loop's flags plus which ZeRO stage, and whose implementation of it."""

    stage: int = arg(2, "ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters",
                     choices=STAGES)
    impl: str = arg("torch", "torch (ZeroRedundancyOptimizer, FSDP2: every stage, CPU and CUDA) or fairscale (OSS, "
                             "ShardedDDP; stage 3 is its FSDP, CUDA only; pip install -e '.[zero]')", choices=IMPLS)
    reduce_buffer_size: Optional[int] = arg(None, "fairscale stage 2: elements per owner rank in ShardedDDP's "
                                                  "gradient reduce buffers; None is fairscale's 2**23, 0 shards "
                                                  "every gradient", min=0)

    def validate(self) -> None:
        super().validate()
        on_cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        check_zero(self.impl, self.stage, self.precision, on_cuda, self.reduce_buffer_size)
# <<< ZERO


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


def train_rank(cfg: ZeroConfig, env: DistEnv, device: torch.device) -> dict:  # ZERO
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
    val_loader = same_batch_count(val_loader, cfg.impl, cfg.stage, device)  # ZERO: FSDP: as many batches per rank
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
    # >>> ZERO: shard last, as DDP wraps last. The optimizer built above is the baseline's, unchanged: shard()
    # rebuilds its class and hyper-parameters around this rank's shard (ZeroRedundancyOptimizer, OSS) or around
    # the sharded parameters (FSDP). Stage 1 and fairscale's stage 2 broadcast rank 0's weights as DDP does;
    # FSDP needs none (every rank built or loaded the same weights: the seed, the checkpoint). 16-mixed: a loss
    # scaler that all-reduces its inf/NaN check when each rank holds only its shard of the gradients.
    psi = sum(p.numel() for p in raw_model.parameters())  # the paper's psi, counted before sharding
    model, optimizer = shard(raw_model, optimizer, cfg.impl, cfg.stage, device, cfg.precision, cfg.reduce_buffer_size)
    amp.scaler = shard_aware_scaler(amp.scaler, cfg.impl, cfg.stage, device, cfg.loss_scale_growth_interval)
    # <<< ZERO
    # >>> DDP: the weights are built and equal on every rank; from here each rank draws its own random numbers
    # (dropout masks, augmentations, DataLoader workers' seeds), not one stream N times over
    seed_everything(cfg.seed + env.rank)
    # <<< DDP
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    early = EarlyStopping(cfg.monitor, cfg.early_stop_patience, cfg.early_stop_min_delta)
    start_epoch, skip_micro_steps, step, samples_seen, best = resume_point(ckpt)
    if ckpt:
        # >>> ZERO: every rank reads the full state (any loop's checkpoint) and keeps its own shard of it
        load_optimizer_state_dict(model, optimizer, ckpt["optimizer"], raw_model, cfg.impl, cfg.stage)
        # <<< ZERO
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
    log.print(f"zero: stage {cfg.stage}, {type(model).__name__} + {type(optimizer).__name__}")  # ZERO

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
                zero_grad(model, optimizer, cfg.impl, cfg.stage)  # ZERO: ShardedDDP zeroes its buckets in place
            # Accumulation: weight each micro-batch's mean loss by its share of the window's samples, so the
            # window's gradient is the mean over all its samples, as one big batch (also for the epoch's
            # last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)

            # >>> DDP: inside no_sync() backward only adds into each rank's own .grad; the window's last micro-step
            # runs outside it and its backward all-reduces the accumulated sums. One all-reduce per optimizer step,
            # not per micro-batch, and the same mean gradient. (Forward is inside too: DDP prepares the reducer there.)
            with no_sync(model, cfg.impl, cfg.stage, window_end):  # ZERO: none under FSDP: gradients stay sharded
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
                    clip_grad_norm(model, optimizer, cfg.grad_clip, cfg.impl, cfg.stage)  # ZERO: over all shards
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
            # >>> ZERO: FSDP evaluates through its own forward (it gathers the parameters); stage 2 then frees them
            loss_total, correct, count = evaluate(eval_module(model, cfg.impl, cfg.stage), val_loader, device, amp,
                                                  cfg.eval_mode)
            reshard(model, cfg.impl, cfg.stage)
            # <<< ZERO
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
        # >>> ZERO: gathering the full state is a collective: every rank calls it, rank 0 receives it. The cost is
        # one gather of the model and the optimizer state per epoch, and rank 0 must hold them (docs/zero.md: the
        # sharded alternative)
        model_state = full_model_state_dict(model, raw_model, cfg.impl, cfg.stage)
        optimizer_state = full_optimizer_state_dict(model, optimizer, raw_model, cfg.impl, cfg.stage)
        # <<< ZERO
        rng_per_rank = [None] * env.world_size
        dist.all_gather_object(rng_per_rank, capture_rng())  # a collective: every rank sends its RNG streams
        if env.master_process:
            checkpoint = build_checkpoint(
                model_state=model_state, optimizer_state=optimizer_state,  # ZERO
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
        # >>> ZERO: the full weights into every rank's shard, then the same evaluation as above
        load_full_model_state_dict(model, raw_model, load_checkpoint(out_dir / "best.pt")["model"], cfg.impl,
                                   cfg.stage)
        loss_total, correct, count = evaluate(eval_module(model, cfg.impl, cfg.stage), val_loader, device, amp,
                                              cfg.eval_mode)
        reshard(model, cfg.impl, cfg.stage)
        # <<< ZERO
        sums = torch.stack([loss_total, correct, count])
        dist.all_reduce(sums)
        loss_total, correct, count = sums
        # <<< DDP
        val_loss, val_acc = (loss_total / count).item(), (correct / count).item()
        log.print(f"restored best weights (epoch {early.best_epoch + 1}): "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
    # >>> ZERO: what each rank holds now, between steps (the last step's gradients are still allocated), gathered
    # to rank 0, next to the paper's formulas for these dtypes (the parameters' dtype: autocast keeps fp32 weights)
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, per_rank_bytes(model, optimizer))
    # the weights' dtype: fp32 in every precision but 64-true (autocast and FSDP's mixed precision compute in 16
    # bits from fp32 weights; the paper's 2 + 2 bytes are O2-style fp16 weights, refused by check_zero)
    nbytes = torch.empty((), dtype=param_dtype(cfg.precision)).element_size()
    per_param = dict(param_bytes=nbytes, grad_bytes=nbytes, state_bytes=state_bytes_per_param(cfg.optimizer, nbytes))
    formula = zero_formula_bytes(psi, env.world_size, cfg.stage, **per_param)
    formula_ddp = zero_formula_bytes(psi, env.world_size, 0, **per_param)
    # <<< ZERO
    summary = run_summary(
        # >>> DDP: the summary of the whole group (samples_seen counts every rank's)
        script=SCRIPT, world_size=env.world_size, device=device, cfg=cfg, global_batch_size=global_batch_size,
        epoch=epoch,
        # <<< DDP
        step=step, samples_seen=samples_seen, samples_this_run=samples_seen - samples_at_start, val_loss=val_loss,
        val_acc=val_acc, best=best, early=early, amp=amp, wall_s=wall_s, data_wait_s=data_wait_s,
        # >>> ZERO: the run's sharding, its psi, what each rank held and the formulas for this stage and for DDP
        peak_mem_bytes=peak_mem_bytes(device), checkpoint=out_dir / "last.pt", lr=lr,
        zero_impl=cfg.impl, zero_stage=cfg.stage, psi=psi, per_rank_bytes=per_rank, zero_formula_bytes=formula,
        ddp_formula_bytes=formula_ddp)
    log.print(format_table(f"bytes per rank (--impl {cfg.impl} --stage {cfg.stage}, {env.world_size} ranks, psi "
                           f"{psi:,}; formulas with {per_param['param_bytes']} + {per_param['grad_bytes']} + "
                           f"{per_param['state_bytes']} bytes per parameter)", per_rank, formula, formula_ddp))
    # <<< ZERO
    log.write_summary(summary)
    log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f} after {step} steps in {wall_s:.1f} s; "
              f"outputs in {out_dir}")
    log.close()
    return summary
