"""Shared test helpers: configs without argv, real CLI subprocesses, parameter comparisons."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from manual_train.config import Config, parse_config

REPO = Path(__file__).resolve().parents[1]


def make_cfg(tmp_path: Path, config_cls=Config, **overrides) -> Config:
    """A validated config as the CLI would build it (progress bar off, outputs under tmp_path)."""
    overrides.setdefault("progress", False)
    overrides.setdefault("out_dir", str(tmp_path / "run"))
    argv = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return parse_config(config_cls, argv)


def max_param_diff(a: dict, b: dict) -> float:
    """Max abs difference over the floating tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def train_state(module, config_cls, tmp_path: Path, name: str, **overrides) -> tuple[dict, dict]:
    """Run a loop module's train(cfg) in this process under tmp_path/name; (final weights, summary)."""
    summary = module.train(make_cfg(tmp_path / name, config_cls, **overrides))
    return load_model_state(tmp_path / name / "run"), summary


# The seq2seq parity settings of the MP and hybrid tests. SGD, not Adam: Adam divides each gradient element by
# its running RMS, which turns rounding-level differences in near-zero gradients (a GRU over 4 rows instead of
# 10 rounds differently) into learning-rate-sized updates; with SGD they stay rounding-sized (~6e-8 after 6 steps).
SEQ = dict(dataset="reverse", model="seq2seq", synthetic_size=200, optimizer="sgd", lr=0.5, batch_size=10,
           max_steps=6, log_every=2)


def load_model_state(run_dir: Path, name: str = "last.pt") -> dict:
    return torch.load(Path(run_dir) / name, map_location="cpu", weights_only=True)["model"]


def run_script(script: str, *args: str, timeout: float = 240, launcher: list[str] | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run launch/<script>.py as a user would (a real subprocess), capturing its output."""
    cmd = (launcher or [sys.executable]) + [str(REPO / "launch" / f"{script}.py"), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


def cuda_devices(n: int = 1):
    """Mark a test as GPU-only: skipped unless at least n CUDA devices exist."""
    return [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < n,
                                                reason=f"needs {n} CUDA device(s)")]


def needs_cuda(n: int = 1):
    """Decorator: mark gpu, and skip unless at least n CUDA devices exist."""

    def decorate(fn):
        for mark in cuda_devices(n):
            fn = mark(fn)
        return fn

    return decorate


def torchrun(nproc: int, *extra: str) -> list[str]:
    """The launcher prefix for run_script: real torchrun, one node, nproc processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *extra]


def run_ok(script: str, *args: str, launcher=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """run_script that must succeed (stderr's tail in the failure message)."""
    proc = run_script(script, *args, launcher=launcher, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def lone_process():
    """No torchrun environment; afterwards os.environ as it was (setup() adds MASTER_ADDR/MASTER_PORT)."""
    saved = dict(os.environ)
    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)
