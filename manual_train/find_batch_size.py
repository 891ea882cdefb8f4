"""python -m manual_train.find_batch_size: the largest --batch-size one training step fits in.

    python -m manual_train.find_batch_size --model resnet18 --dataset synthetic --device cuda
    python -m manual_train.find_batch_size --model cnn --memory-budget-bytes 300000000   # CPU: a cap

Takes the training flags that change what one step holds in memory (dataset, model, precision,
optimizer, device, seed) plus its own; the other training flags do not apply and are refused.
Each trial is one forward, backward and optimizer step on a batch of that size.
CUDA: trials run in this process and a size fits unless torch.cuda.OutOfMemoryError is raised.
CPU: each trial runs in a fresh subprocess (so one trial's memory cannot hide another's) and a size
fits when the step's peak memory, measured as the growth of the process's peak resident set over
what it held before the step, stays within --memory-budget-bytes. The answer is per process; the
global batch is this times --accumulate times the world size.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from manual_train.batch_size import cuda_step_fits, find_max_batch_size
from manual_train.config import Config, UsageError, arg, parse_config

# The Config fields one trial step reads that can change its memory (the rest keep their defaults): the data (its
# shape, and the training-set size, the default --max-batch-size), the model, the precision, the optimizer (its state
# and kernel), activation checkpointing, the device, and the seed of the weights. --lr, --weight-decay and the loss-
# scale flags are read too but change no byte, so they are not offered.
STEP_FLAGS = ("dataset", "data_root", "download", "synthetic_size", "synthetic_shape", "synthetic_classes", "model",
              "optimizer", "optimizer_impl", "precision", "activation_checkpointing", "device", "seed")


@dataclass
class FindConfig(Config):
    """Config (whose fields the step code reads), of which the parser offers STEP_FLAGS and these four."""

    memory_budget_bytes: Optional[int] = arg(None, "CPU: the peak memory one training step may use", min=1)
    start: int = arg(1, "first batch size to try", min=1)
    max_batch_size: Optional[int] = arg(None, "largest size to try (default: the training set size)", min=1)
    trial: Optional[int] = arg(None, "internal: run one CPU trial at this size and print its peak bytes", min=1)

    def validate(self) -> None:
        self.validate_step()  # not Config.validate: nothing here uses workers, --resume or an --out-dir
        from manual_train.precision import check_precision
        from manual_train.runtime import resolve_device

        device = resolve_device(self.device)
        check_precision(self.precision, device)  # here, not in the CPU trials' subprocesses
        if device.type == "cpu" and self.memory_budget_bytes is None and self.trial is None:
            raise UsageError("--memory-budget-bytes", "required on CPU (nothing runs out of memory before the "
                                                      "machine swaps)", "a byte count such as 2000000000")


class TrialFailed(Exception):
    """A CPU trial's subprocess failed for a reason of its own (its stderr has been shown)."""


FIELDS = STEP_FLAGS + tuple(f.name for f in dataclasses.fields(FindConfig) if f.name not in
                           {g.name for g in dataclasses.fields(Config)})


def _one_step(cfg: FindConfig, device, train_ds, info, batch_size: int) -> None:
    """One real training step at `batch_size` (samples repeated if the set is smaller)."""
    from manual_train.models import build_model_from, loss_fn
    from manual_train.optim import build_optimizer
    from manual_train.precision import CastInputs, autocast_for, param_dtype

    idx = torch.arange(batch_size) % len(train_ds)
    x, y = torch.utils.data.default_collate([train_ds[int(i)] for i in idx])
    torch.manual_seed(cfg.seed)
    raw_model = build_model_from(cfg, info).to(param_dtype(cfg.precision)).to(device)  # as loops/single.py
    model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model
    optimizer = build_optimizer(cfg, raw_model.parameters(), cfg.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "16-mixed")
    x, y = x.to(device), y.to(device)
    with autocast_for(cfg.precision, device)():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def _cpu_trial(cfg: FindConfig) -> int:
    """Child process: how far one step at --trial pushes the peak resident set above where it was.

    A warm-up step at batch size 1 first pays the one-time costs (kernel libraries, allocator pools),
    which would otherwise be charged to the first trial.
    """
    import os
    import resource

    from manual_train.data import build_datasets

    train_ds, _, info = build_datasets(cfg)
    cpu = torch.device("cpu")
    _one_step(cfg, cpu, train_ds, info, 1)
    with open("/proc/self/statm") as f:
        rss_now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    _one_step(cfg, cpu, train_ds, info, cfg.trial)
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_now)


def main(argv=None) -> int:
    try:
        cfg = parse_config(FindConfig, argv, prog="python -m manual_train.find_batch_size", description=__doc__,
                           fields=FIELDS)
        if cfg.trial is not None:
            print(json.dumps({"batch_size": cfg.trial, "peak_bytes": _cpu_trial(cfg)}))
            return 0
        from manual_train.data import build_datasets
        from manual_train.runtime import resolve_device

        device = resolve_device(cfg.device)
        train_ds, _, info = build_datasets(cfg)
        limit = cfg.max_batch_size or len(train_ds)
        if device.type == "cuda":
            fits = cuda_step_fits(lambda b: _one_step(cfg, device, train_ds, info, b), device)
        else:
            argv_base = [f"--{k.replace('_', '-')}={getattr(cfg, k)}" for k in STEP_FLAGS
                         if getattr(cfg, k) is not None and not isinstance(getattr(cfg, k), bool)]

            def fits(b: int) -> bool:
                out = subprocess.run([sys.executable, "-m", "manual_train.find_batch_size", *argv_base,
                                      "--device=cpu", f"--trial={b}"], capture_output=True, text=True)
                if out.returncode != 0:  # not a user error (the flags passed here): show the child's own report
                    sys.stderr.write(out.stderr)
                    raise TrialFailed(f"the trial at batch size {b} failed (exit status {out.returncode}); "
                                      "its output is above")
                peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
                print(f"  batch {b}: peak {peak / 2**20:.1f} MiB", file=sys.stderr)
                return peak <= cfg.memory_budget_bytes

        best = find_max_batch_size(fits, cfg.start, limit, log=lambda m: print(m, file=sys.stderr))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrialFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if best == 0:
        print(f"error: --start: batch size {cfg.start} already does not fit", file=sys.stderr)
        return 1
    print(f"largest batch size that fits: {best}" + (" (the limit)" if best == limit else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
