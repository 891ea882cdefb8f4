"""What one GPU can prove (marker `gpu`; skipped without CUDA, run by scripts/gpu_check.sh on a GPU machine).

Most GPU tests need two or four GPUs. These run the multi-device loops with one GPU named twice (model
parallelism and the dp-mp hybrid: both halves on cuda:0, the same code path as two GPUs less the copies between
them), check that --deterministic holds on CUDA with the default cnn, and that each run reports its own CUDA
peak memory. The CPU side of each fix is in tests/test_gpu_readiness.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import SEQ, load_model_state, make_cfg, max_param_diff, needs_cuda, run_ok, train_state

from manual_train.config import Config
from manual_train.loops import hybrid, model_parallel, single


@needs_cuda(1)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_model_parallelism_on_one_gpu_equals_the_baseline(tmp_path, microbatches):
    base, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **SEQ)
    state, summary = train_state(model_parallel, model_parallel.ModelParallelConfig, tmp_path, "mp", devices="cuda:0,cuda:0",
                                 microbatches=microbatches, **SEQ)
    assert max_param_diff(base, state) < 1e-5  # cuDNN's GRU over micro-batches rounds differently
    assert set(summary["peak_mem_bytes_per_device"]) == {"cuda:0"}


@needs_cuda(1)
@pytest.mark.parametrize("impl", ["torch", "explicit"])
def test_hybrid_dp_mp_on_one_gpu_equals_the_baseline(tmp_path, impl, lone_process):
    """dp-mp with --devices cuda:0,cuda:0: a data-parallel group of one device for each half (and, as every
    hybrid run, a process group of one: lone_process keeps a torchrun environment out)."""
    base, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **SEQ)
    state, _ = train_state(hybrid, hybrid.HybridConfig, tmp_path, "h", mode="dp-mp", impl=impl,
                           devices="cuda:0,cuda:0", **SEQ)
    assert max_param_diff(base, state) < 1e-5


@needs_cuda(1)
def test_deterministic_cnn_on_cuda_runs_and_repeats_bit_for_bit(tmp_path):
    """--deterministic is strict (use_deterministic_algorithms(True)): the default cnn's pooling must have a
    deterministic CUDA backward (models.AvgPoolTo2x2), or the first backward raises. Two runs, the same bits."""
    flags = ["--device", "cuda", "--deterministic", "--model", "cnn", "--max-steps", "20", "--no-progress"]
    for name in ("a", "b"):
        run_ok("single", *flags, "--out-dir", str(tmp_path / name))
    a, b = load_model_state(tmp_path / "a"), load_model_state(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["optimizer_steps"] == 20


@needs_cuda(1)
def test_the_cnns_cuda_pooling_matches_the_cpu():
    """avg_pool2d on CUDA, the adaptive kernel on the CPU: the same averages, and a backward that strict
    determinism accepts."""
    from manual_train.models import AvgPoolTo2x2

    pool = AvgPoolTo2x2()
    x = torch.randn(4, 64, 14, 14, dtype=torch.float64)
    on_gpu = x.cuda().requires_grad_()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = pool(on_gpu)
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    torch.testing.assert_close(out.cpu(), pool(x), rtol=1e-12, atol=1e-14)  # GPU sums in another order
    torch.testing.assert_close(on_gpu.grad.cpu(), torch.full_like(x, 1 / 49), rtol=1e-15, atol=0)


@needs_cuda(1)
def test_each_run_reports_its_own_peak_memory(tmp_path):
    """Two runs in one process: a resnet18 on 256 images of 32x32, then the mlp on digits. The second reports the
    mlp's peak (a few MB), not the process's (the resnet's hundreds of MB)."""
    big = single.train(make_cfg(tmp_path / "big", device="cuda", model="resnet18", dataset="synthetic",
                                synthetic_size=512, batch_size=256, max_steps=2))
    small = single.train(make_cfg(tmp_path / "small", device="cuda", model="mlp", max_steps=2))
    assert big["peak_mem_bytes"] > 100 * 2 ** 20, big["peak_mem_bytes"]
    assert small["peak_mem_bytes"] < big["peak_mem_bytes"] / 10, (small["peak_mem_bytes"], big["peak_mem_bytes"])

