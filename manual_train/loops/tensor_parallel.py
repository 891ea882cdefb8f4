# >>> TENSOR_PARALLEL: the docstring: what is split, the commands, and what differs from the ZeRO loop
"""Tensor parallelism under torchrun: every attention and MLP of the GPT split over --tp ranks (Megatron-LM's
column/row split, torch.distributed.tensor.parallel), and 2-D: FSDP2 over --dp replicas of that.

    torchrun --nproc_per_node=2 launch/tensor_parallel.py                  # --tp 2: every rank the same batches
    torchrun --nproc_per_node=4 launch/tensor_parallel.py --dp 2 --tp 2    # 2-D: a (dp 2, tp 2) DeviceMesh
    torchrun --nproc_per_node=2 launch/tensor_parallel.py --sequence-parallel   # LayerNorms on s/tp positions each
    torchrun --nproc_per_node=2 launch/tensor_parallel.py --epochs 1 --out-dir T   # the weights of (1e-9 in 64-true):
    python launch/single.py --model gpt --dataset reverse --optimizer adamw --lr 3e-3 --batch-size 16 --epochs 1

`diff manual_train/loops/zero.py manual_train/loops/tensor_parallel.py` is the lesson; every changed line is marked
TENSOR_PARALLEL. Its parent is the ZeRO loop because 2-D is ZeRO's FSDP2 with TP inside each replica: the
data-parallel numbers count replicas (dp_coords), not ranks, and parallelize() (manual_train/tensor_parallel.py)
replaces shard() with zero's interface. What each change does, checkpoints and the bytes per rank: docs/tensor_parallel.md.
"""
# <<< TENSOR_PARALLEL
from __future__ import annotations

import math
# ZERO: no contextlib.nullcontext: sharded.no_sync() chooses the context

import torch
# ZERO: no DistributedDataParallel: shard() builds the wrapper

from manual_train import data
from manual_train.config import Config
from manual_train.distributed import DistEnv, all_sum, process_group, sync_batchnorm  # ZERO: not DDPConfig, no hook
from manual_train.evaluation import evaluate
from manual_train.models import build_model_from, log_sums, loss_fn
from manual_train.optim import build_optimizer, build_scheduler, scaled_lr
from manual_train.plugins import build_loss
from manual_train.precision import CastInputs, autocast_for, param_dtype
from manual_train.run import Run
from manual_train.runtime import seed_everything, set_deterministic  # DDP: process_group picks the device
from manual_train.tensor_parallel import TensorParallelConfig, dp_coords, parallelize  # TENSOR_PARALLEL

SCRIPT = "tensor_parallel"  # TENSOR_PARALLEL
# >>> TENSOR_PARALLEL: the GPT on its task, as launch/pipeline.py. --batch-size is per replica: 16 gives --dp 2 the
# baseline's global batch of 32, and with it the baseline's run (0.999 val acc); --tp 2 alone steps twice as often
# (1.000)
DEFAULTS = dict(model="gpt", dataset="reverse", optimizer="adamw", lr=3e-3, epochs=4, batch_size=16)
__all__ = ["TensorParallelConfig", "DEFAULTS", "train"]
# <<< TENSOR_PARALLEL


def train(cfg: TensorParallelConfig) -> dict:  # TENSOR_PARALLEL
    # ------------------------------------------------------------------ setup
    # >>> DDP: who this process is (torchrun's environment) and its device (cuda:LOCAL_RANK, bound before
    # init_process_group), inside the process group, which it leaves on every exit path (distributed.process_group)
    with process_group(cfg) as (env, device):
        return train_rank(cfg, env, device)


def train_rank(cfg: TensorParallelConfig, env: DistEnv, device: torch.device) -> dict:  # TENSOR_PARALLEL
    # <<< DDP
    seed_everything(cfg.seed)
    set_deterministic(cfg.deterministic)
    torch.autograd.set_detect_anomaly(cfg.detect_anomaly)  # --detect-anomaly: backward names the op that made a NaN
    train_ds, val_ds, info = data.build_datasets(cfg)
    # >>> DDP: rank r trains on perm[r::N] and evaluates val[r::N]; no padding with repeats (pad=False): a short shard
    # ends in an empty micro-batch. The weights use the whole set's numbers: n_all samples, micro_batch = N x batch
    # samples per micro-step (docs/ddp.md, "The sampler")
    # >>> TENSOR_PARALLEL: N is the number of replicas (dp), r this rank's replica: the tp ranks of a replica share its
    # batches
    dp, dp_rank = dp_coords(cfg, env)
    sampler = data.train_sampler(train_ds, cfg.seed, dp, dp_rank, pad=False)
    train_loader = data.build_loader(train_ds, cfg, device, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = data.build_loader(data.eval_shard(val_ds, dp, dp_rank), cfg, device, batch_size=cfg.eval_batch_size)
    micro_batch = cfg.batch_size * dp
    # <<< TENSOR_PARALLEL
    n_all = data.limit_train(len(train_ds), cfg, micro_batch)  # --limit-train-batches: this epoch's samples
    # <<< DDP
    n_train = data.limit_train(len(sampler), cfg)  # --limit-train-batches (--fast-dev-run: 1): the epoch's samples
    global_batch_size = cfg.batch_size * cfg.accumulate * dp  # TENSOR_PARALLEL: one step averages all replicas
    micro_steps_per_epoch = data.micro_batches_per_epoch(n_train, cfg.batch_size)
    windows = data.Windows(train_ds, sampler, cfg)  # the targets of each micro-batch and window, every rank's
    steps_per_epoch = data.steps_per_epoch(n_train, cfg.batch_size, cfg.accumulate)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    lr = scaled_lr(cfg, global_batch_size)
    run = Run(cfg, SCRIPT, device=device, lr=lr, global_batch_size=global_batch_size, total_steps=total_steps,
              micro_steps_per_epoch=micro_steps_per_epoch, datasets=(train_ds, val_ds), env=env,  # TENSOR_PARALLEL
              replicas=dp)  # TENSOR_PARALLEL: rank 0 writes; dp replicas train on shares of every batch

    torch.manual_seed(cfg.seed)  # right before building: the same --seed gives the same weights in every loop
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision)).to(device)  # moved once
    model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model  # 64-true: float64 inputs too
    # >>> ZERO: in place of DDP's wrapper: the baseline's optimizer, then shard() wraps the model and rebuilds the
    # optimizer around this rank's shard, as --impl and --stage say (docs/zero.md, "What each stage shards").
    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)
    sharded = parallelize(sync_batchnorm(model, cfg), optimizer, cfg, device)  # TENSOR_PARALLEL: mesh, TP, FSDP2
    model, optimizer = sharded.model, sharded.optimizer
    val_loader = sharded.same_batch_count(val_loader)  # FSDP's forward is a collective: as many batches per rank
    seed_everything(cfg.seed + dp_rank)  # TENSOR_PARALLEL: a replica's tp ranks draw the same dropout masks
    # <<< ZERO
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    # torch.amp: autocast runs forward and loss in float16 (16-mixed) or bfloat16 (bf16-mixed) where that is safe.
    # fp16 gradients of small losses underflow to zero, so 16-mixed multiplies the loss by a large scale before
    # backward and divides the gradients by it after; bf16 has fp32's range and needs no scaling. Disabled, the
    # GradScaler passes everything through (scale 1).
    autocast = autocast_for(cfg.precision, device)
    # >>> ZERO: a GradScaler whose inf/NaN check spans every rank's shard; checkpoints hold the full state, gathered
    # from every rank (full_model, full_optimizer), and load into this rank's shard (docs/zero.md, "Checkpoints")
    scaler = sharded.grad_scaler(device.type, init_scale=cfg.loss_scale_init, enabled=cfg.precision == "16-mixed",
                                 growth_interval=cfg.loss_scale_growth_interval)
    # <<< ZERO
    criterion = build_loss(cfg, loss_fn)  # the mean cross-entropy, or yours (--loss: docs/your-model.md)

    def validate() -> tuple[float, float]:
        """The validation set's mean loss and accuracy: exact sums, one host sync (.item())."""
        # >>> DDP: this rank's shard through the module itself (DDP's forward broadcasts buffers: a collective, which
        # hangs when shards differ in batch count); the summed sums are one process's, the same on every rank
        # >>> ZERO: FSDP evaluates through its own forward (it gathers the parameters), the others DDP's way;
        # then FSDP2's stage 2 frees what a forward without backward left gathered
        loss_total, correct, count = evaluate(sharded.eval_model, val_loader, device, autocast, cfg.eval_mode,
                                              criterion)
        sharded.reshard()
        # <<< ZERO
        loss_total, correct, count = all_sum(loss_total, correct, count, device=device)
        # <<< DDP
        return (loss_total / count).item(), (correct / count).item()

    start_epoch, start_micro_step, step, samples_seen = run.start(
        model=sharded.full_model, optimizer=sharded.full_optimizer, scheduler=scheduler, scaler=scaler)  # ZERO
    run.print(f"tensor parallel: {sharded}")  # TENSOR_PARALLEL: the mesh, styles and optimizer parallelize() chose

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
                sharded.zero_grad()  # ZERO: optimizer.zero_grad, but ShardedDDP zeroes its reduce buckets in place
            # Accumulation: weight each micro-batch's mean loss by its share of the window's targets (labels, or
            # tokens of text), so the window's gradient is the mean over all its targets, as one big batch (also for
            # the epoch's last, partial window, where dividing by K would shrink it; Lightning issue 19987).
            targets, window_targets = windows.count(micro_step)  # from the sampled indices (data.Windows)
            # >>> DDP: the share of the GLOBAL window (every rank's targets), times N because DDP averages over ranks;
            # an empty micro-batch (weight 0) joins the all-reduce with exact zeros (docs/ddp.md, "The sampler")
            weight = targets * dp / window_targets  # TENSOR_PARALLEL
            # <<< DDP

            # >>> DDP: no_sync(): backward only adds into this rank's .grad; the window's last micro-step all-reduces
            # the sums, once per optimizer step (forward is inside too: DDP prepares the reducer there)
            with sharded.no_sync(window_end):  # ZERO: DDP's, ShardedDDP's; none under FSDP (gradients stay sharded)
                with autocast():  # forward and loss only: backward runs in the dtypes forward chose
                    logits = model(x)
                    loss = criterion(logits, y) * weight  # the micro-batch's share of the window's mean
                scaler.scale(loss).backward()  # 16-mixed: the scaled loss; gradients accumulate scaled
            # <<< DDP

            # Logging without retained graphs: detach() drops autograd history, so nothing of this
            # step's graph outlives the step (keeping `loss` itself would keep the step's graph).
            losses.append(loss.detach() if weight else torch.zeros_like(loss))  # DDP: an empty batch's mean: NaN
            if cfg.train_acc:  # --no-train-acc: none (Lightning logs no train accuracy unless asked)
                predictions.append(logits.detach().argmax(-1)), labels.append(y)
            log_targets += targets
            samples_seen += data.window_samples(n_all, micro_batch, 1, micro_step)  # DDP: every rank's, this micro-step

            if window_end:
                scaler.unscale_(optimizer)  # true gradients before clipping (a no-op when the scaler is off)
                if cfg.grad_clip:
                    sharded.clip_grad_norm(cfg.grad_clip)  # ZERO: the norm over every rank's shard (a collective)
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
                    # >>> DDP: the log window's sums from every rank: the logged loss becomes the global mean, and a
                    # NaN on any rank reaches every rank, so they all stop together. One small all-reduce per log row.
                    loss_total, correct_total, targets = all_sum(loss_sum, correct, log_targets, device=device)
                    # .item() is a host sync: it waits for every queued kernel. Here once per log row.
                    train_loss = (loss_total / (log_steps * env.world_size)).item()
                    train_acc = (correct_total / targets).item()
                    # <<< DDP
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
    # >>> ZERO: the bytes each rank holds now (parameters, gradients, optimizer state) next to the paper's formulas
    table, memory = sharded.memory_report()
    run.print(table)
    return run.finish(epoch, step, samples_seen, val_loss, val_acc, restored=restored, **memory)  # summary.json
    # <<< ZERO
