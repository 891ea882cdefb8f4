"""Device choice, device lists, seeding and determinism: set-up shared by every loop.

parse_devices reads the single-process scripts' `--devices cpu,cpu` or `cuda:0,cuda:1` (launch/data_parallel.py,
launch/model_parallel.py, launch/hybrid.py), validated up front; listing `cpu` several times means that many
chunks or stages on the one CPU.
"""
from __future__ import annotations

import os
import random
from typing import Optional, Sequence

import numpy as np
import torch

from manual_train.errors import UsageError

DEVICE_LIST_ALLOWED = "a comma list of cpu and cuda:N, e.g. cpu,cpu or cuda:0,cuda:1"


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


def parse_devices(text: str, flag: str = "--devices", *, count: Optional[int] = None, even: bool = False,
                  cuda_repeats: bool = False, same_type: bool = False, role: str = "this script",
                  check_machine: bool = True) -> list:
    """'cpu,cpu' or 'cuda:0,cuda:1' -> [torch.device, ...]; every mistake is a one-line UsageError.

    count: exactly this many entries. even: an even number (two groups of equal size).
    cuda_repeats: a GPU may appear twice (model parallelism on one GPU); `cpu` may always repeat.
    same_type: all cpu or all cuda (scatter/gather is either chunking or torch.nn.parallel).
    check_machine: False checks the list only, not that this machine has the GPUs it names.
    Checks run from syntax to machine, so a malformed list is reported the same on every host.
    """
    names = [n.strip() for n in text.split(",")]
    for name in names:
        if not name:
            raise UsageError(flag, f"empty entry in {text!r}", DEVICE_LIST_ALLOWED)
        if name != "cpu" and not (name.startswith("cuda:") and name[5:].isdigit()):
            hint = " (name each GPU: cuda:0, cuda:1, ...)" if name == "cuda" else ""
            raise UsageError(flag, f"unknown device {name!r}{hint}", "cpu, cuda:N")
    if count is not None and len(names) != count:
        raise UsageError(flag, f"{len(names)} device(s) given; {role} needs exactly {count}", DEVICE_LIST_ALLOWED)
    if even and len(names) % 2:
        raise UsageError(flag, f"{len(names)} devices given; {role} needs an even number (two equal groups)",
                         "e.g. cpu,cpu,cpu,cpu or cuda:0,cuda:1,cuda:2,cuda:3")
    if same_type and len({name.split(":")[0] for name in names}) > 1:
        raise UsageError(flag, f"{text} mixes cpu and cuda; {role} needs devices of one kind",
                         "all cpu or all cuda:N")
    repeated = sorted({n for n in names if n != "cpu" and names.count(n) > 1})
    if repeated and not cuda_repeats:
        raise UsageError(flag, f"{repeated[0]} is listed twice; {role} needs distinct GPUs",
                         "each cuda:N once (cpu may repeat)")
    wanted = sorted({int(n[5:]) for n in names if n != "cpu"})
    if wanted and check_machine:
        if not torch.cuda.is_available():
            raise UsageError(flag, f"{', '.join(f'cuda:{i}' for i in wanted)} requested but CUDA is not available "
                                   "on this machine", "cpu,cpu")
        have = torch.cuda.device_count()
        if wanted[-1] >= have:
            raise UsageError(flag, f"cuda:{wanted[-1]} requested but this machine has only {have} CUDA device(s)",
                             ", ".join(f"cuda:{i}" for i in range(have)))
    return [torch.device(n) for n in names]


def cuda_list(n: int) -> str:
    """The --devices text of the first n GPUs: cuda:0,...,cuda:n-1."""
    return ",".join(f"cuda:{i}" for i in range(n))


def peak_mem_per_device(devices: Sequence[torch.device]) -> dict:
    """summary.json's peak_mem_bytes_per_device: each distinct device's peak (on the CPU: one process, one number).
    Data parallelism shows its imbalance here (the output device holds more); model parallelism its halves."""
    return {str(d): peak_mem_bytes(d) for d in dict.fromkeys(devices)}
