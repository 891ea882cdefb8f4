"""Device choice, seeding and determinism: set-up shared by every loop."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


class TrainingDiverged(RuntimeError):
    """The training loss became NaN/inf: the run stops, keeping its last good checkpoint (exit 1)."""

    @classmethod
    def at(cls, loss: float, step: int, log_steps: int, last_checkpoint) -> "TrainingDiverged":
        where = f"at step {step}" if log_steps == 1 else f"in the log window of steps {step - log_steps + 1}-{step}"
        kept = (f"last good checkpoint: {last_checkpoint}" if os.path.exists(last_checkpoint)
                else "no checkpoint was written yet")
        return cls(f"training loss is {loss} {where}; stopped (a lower --lr or --grad-clip may help); {kept}")


def resolve_device(name: str) -> torch.device:
    """--device auto picks CUDA when present; validation already refused CUDA names without CUDA."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device). Loops reseed torch right before building the model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """--deterministic: refuse nondeterministic kernels, and make cuDNN pick deterministic ones.

    Every loop calls this once, right after seeding, at the start of its run, so it also starts the run's CUDA
    peak-memory count (reset_peak_mem below).

    Strict (use_deterministic_algorithms(True), not warn_only): an op with no deterministic CUDA kernel raises
    at its first call instead of warning and running the nondeterministic one, so a run that finishes with
    --deterministic was deterministic. The models here avoid such ops on CUDA: the cnn pools with avg_pool2d
    there (AdaptiveAvgPool2d's CUDA backward adds with atomics and is refused; models.AvgPoolTo2x2), resnet18's
    1x1 adaptive pooling is computed as a mean, and cross_entropy gets (N, C) logits (the 2-d NLLLoss kernel is
    the refused one). Costs speed on GPUs (no cuDNN autotuning, some slower kernels, uninitialised memory filled);
    on the CPU paths used here the default kernels are already deterministic run to run.
    """
    reset_peak_mem()
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first call
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def reset_peak_mem() -> None:
    """Start a new peak for peak_mem_bytes on every CUDA device this process has used.

    The caching allocator's peak counts from process start until reset, so a second run in one process (tests,
    benchmark children, a notebook) would report the first run's peak as its own. Only when CUDA is already
    initialised: before that nothing was allocated, and touching the devices would create a context on each.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)  # host-side bookkeeping: no sync, no context created


def peak_mem_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak of allocated bytes on `device` since the run started (reset_peak_mem).
    CPU: the process's peak resident set since the process started (getrusage; it cannot be reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
