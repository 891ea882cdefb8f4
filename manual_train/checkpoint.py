"""Checkpoints that survive crashes and resume exactly (docs/checkpointing.md).

A checkpoint is a plain dict (DESIGN.md): model (the unwrapped model's fp32 state_dict), optimizer,
scheduler, scaler, epoch, step, rng, early_stopping, config, world_size, plus `progress` (where in
the epoch it was written and the run's counters). Everything in it is a tensor or a Python
primitive, so it loads with `torch.load(weights_only=True)`: loading never runs pickled code.

Exact resume needs the RNG streams too (Lightning's checkpoints hold none): python `random`,
numpy, torch CPU and every CUDA device. The sampler's order needs nothing saved: it is
DistributedSampler(seed) at `epoch`, recomputed from the two numbers.

Writes are atomic: the bytes go to a temporary file in the same directory, are fsync'ed, and
os.replace() swaps it in, so a crash mid-write leaves the previous last.pt whole.
"""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from manual_train.config import Config, UsageError

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "early_stopping",
                 "config", "world_size")
# Flags that change what is trained: a resume continues the same training, so these must match the checkpoint's.
# (--batch-size, --accumulate and the world size may change as long as the global batch does not; --epochs and
# --max-steps may grow when the LR schedule does not depend on the run's length; the rest, e.g. workers,
# logging, evaluation and --precision, may change freely.)
MUST_MATCH = ("model", "dataset", "synthetic_size", "synthetic_shape", "synthetic_classes", "optimizer", "lr",
              "lr_scaling", "base_batch_size", "weight_decay", "grad_clip", "grad_clip_value", "schedule",
              "warmup_steps", "seed", "dropout", "limit_train_batches")


class RunFinished(Exception):
    """--resume of a run that already reached its end: nothing to train, nothing is written (exit status 0)."""


def capture_rng() -> dict:
    """Every RNG stream a run draws from, as tensors and primitives (weights_only-loadable)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then os.replace: all or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new, never half
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # and the rename itself survives a power cut
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temp_files(out_dir: Path) -> None:
    """Remove the temporary files of save_checkpoint (and summary.json's) left by a process that was killed while
    writing them: `.<name>.tmp-<pid>` whose pid no longer runs. A live writer's file is left alone."""
    for tmp in Path(out_dir).glob(".*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal is sent, only the existence and permission checks are made
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True


def load_checkpoint(path: Path, flag: str = "--resume") -> dict:
    """Load with weights_only=True onto the CPU; a corrupt or foreign file is a one-line UsageError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(flag, f"no checkpoint file at {path}") from None
    except Exception as e:  # truncated zip, random bytes, pickled code that weights_only refuses, ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(flag, f"{path} is not a readable checkpoint ({first_line[:160]})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
        raise UsageError(flag, f"{path} is not a manual_train checkpoint (missing: {', '.join(missing)})")
    return state


def check_compatible(ckpt: dict, cfg: Config, global_batch_size: int, total_steps: int,
                     flag: str = "--resume") -> None:
    """Refuse, in one line naming the flag, a resume that would not continue the checkpoint's training; raise
    RunFinished when there is nothing left to train. Called before anything is written."""
    saved = ckpt["config"]
    for name in MUST_MATCH:
        if name in saved and saved[name] != getattr(cfg, name):
            raise UsageError(flag, f"checkpoint was trained with --{name.replace('_', '-')} {saved[name]}, "
                                   f"this run has {getattr(cfg, name)}")
    # The global batch fixes which samples each optimizer step averages (the sampler's order is per sample).
    saved_global = saved["batch_size"] * saved["accumulate"] * ckpt["world_size"]
    if global_batch_size != saved_global:
        raise UsageError("--batch-size", f"global batch {global_batch_size} differs from the checkpoint's "
                                         f"{saved_global} (batch x accumulate x world size): the steps after the "
                                         "resume would average other samples", f"a global batch of {saved_global}")
    micro_steps_done = ckpt.get("progress", {}).get("micro_steps_done", 0)
    world_size = global_batch_size // (cfg.batch_size * cfg.accumulate)
    if micro_steps_done and (cfg.batch_size * world_size, cfg.accumulate) != (
            saved["batch_size"] * ckpt["world_size"], saved["accumulate"]):
        raise UsageError("--batch-size", f"the checkpoint stopped mid-epoch after {micro_steps_done} micro-batches "
                                         f"of {saved['batch_size']} x {ckpt['world_size']} ranks, accumulate "
                                         f"{saved['accumulate']}; its place in the epoch is counted in those",
                         f"--batch-size {saved['batch_size']} --accumulate {saved['accumulate']} at world size "
                         f"{ckpt['world_size']}, or resume from an epoch's end")
    for name in ("epochs", "max_steps"):
        if cfg.schedule != "constant" and saved.get(name) != getattr(cfg, name):
            raise UsageError(f"--{name.replace('_', '-')}", f"{getattr(cfg, name)} changes the length of the "
                             f"{cfg.schedule} LR schedule the checkpoint follows ({saved.get(name)}): the LR of "
                             "every later step would differ from the run's", f"{saved.get(name)}")
    step = int(ckpt["step"])
    if step > total_steps:
        raise UsageError("--max-steps" if cfg.max_steps else "--epochs",
                         f"this run ends after {total_steps} optimizer steps, before the checkpoint's step {step}",
                         f"more than {step} steps (--epochs or --max-steps)")
    if step == total_steps or ckpt["early_stopping"].get("should_stop"):
        how = "stopped early" if ckpt["early_stopping"].get("should_stop") else f"all {total_steps} steps done"
        raise RunFinished(f"nothing to do: the checkpoint's run is finished ({how}); its outputs are left as they "
                          "are (raise --epochs or --max-steps to train on, with --schedule constant)")


def build_checkpoint(*, model_state: dict, optimizer_state: dict, scheduler, scaler_state: dict, early_stopping,
                     cfg: Config, epoch: int, micro_steps_done: int, step: int, samples_seen: int, best: dict,
                     world_size: int, **extra) -> dict:
    """The checkpoint dict of DESIGN.md. `epoch` is the epoch being run; micro_steps_done > 0 means
    it stopped mid-epoch (--max-steps), and a resume starts the sampler at that point."""
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler_state,
        "epoch": epoch,
        "step": step,
        "rng": capture_rng(),
        "early_stopping": early_stopping.state_dict(),
        "config": dataclasses.asdict(cfg),
        "world_size": world_size,
        "progress": {"micro_steps_done": micro_steps_done, "samples_seen": samples_seen, "best": best},
        **extra,
    }


def resume_point(ckpt: Optional[dict]) -> tuple[int, int, int, int, dict]:
    """(epoch, micro_steps_done, step, samples_seen, best) to continue from; zeros for a fresh run."""
    if ckpt is None:
        return 0, 0, 0, 0, {}
    progress = ckpt.get("progress", {})
    return (int(ckpt["epoch"]), int(progress.get("micro_steps_done", 0)), int(ckpt["step"]),
            int(progress.get("samples_seen", 0)), dict(progress.get("best", {})))
