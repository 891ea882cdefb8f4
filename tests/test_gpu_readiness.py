"""What reading the CUDA paths found, checked on the CPU wherever a CPU can check it.

The rest runs where a GPU is present (tests/test_one_gpu.py, the gpu-marked tests of the other files), through
scripts/gpu_check.sh, whose own parts are checked here too: its syntax and how it counts the tests that ran.
A CUDA machine is imitated (torch.cuda.is_available, device_count) only where the code under test merely asks
whether one is there.
"""
from __future__ import annotations

import configparser
import copy
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import REPO, as_torchrun_rank, make_cfg

from manual_train import runtime
from manual_train.config import UsageError
from manual_train.distributed import read_env
from manual_train.loops import hybrid, model_parallel
from manual_train.loops import zero as zero_loop
from manual_train.models import AvgPoolTo2x2, SmallCNN
from manual_train.zero import check_zero

GPU_CHECK = REPO / "scripts" / "gpu_check.sh"


@pytest.fixture
def one_gpu_machine(monkeypatch):
    """torch believes one CUDA device exists (nothing may allocate on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


# ---------------------------------------------------------------------- fairscale's FSDP needs two ranks
ONE_RANK_ERROR = ("--impl: fairscale --stage 3 needs 2 or more ranks: with one, fairscale's FSDP shards nothing and "
                  "fails gathering its optimizer state for the checkpoint (allowed: --impl torch (FSDP2 runs as a "
                  "group of one), or torchrun --nproc_per_node >= 2)")


def test_fairscale_stage_3_with_one_rank_is_refused(monkeypatch):
    pytest.importorskip("fairscale")
    with pytest.raises(UsageError) as refused:
        check_zero("fairscale", 3, "32-true", on_cuda=True, reduce_buffer_size=None, world_size=1)
    assert str(refused.value) == ONE_RANK_ERROR
    check_zero("fairscale", 3, "32-true", on_cuda=True, reduce_buffer_size=None, world_size=2)  # accepted
    check_zero("torch", 3, "bf16-mixed", on_cuda=True, reduce_buffer_size=None, world_size=1)  # FSDP2: a group of one
    # the world size comes from torchrun's environment when not given: a plain `python` process is one rank
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match="needs 2 or more ranks"):
        check_zero("fairscale", 3, "32-true", on_cuda=True, reduce_buffer_size=None)
    as_torchrun_rank(monkeypatch, world_size=2)
    check_zero("fairscale", 3, "32-true", on_cuda=True, reduce_buffer_size=None)


def test_the_zero_config_refuses_it_before_anything_starts(tmp_path, monkeypatch, one_gpu_machine):
    pytest.importorskip("fairscale")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError) as refused:
        make_cfg(tmp_path, zero_loop.ZeroConfig, impl="fairscale", stage=3, device="cuda")
    assert str(refused.value) == ONE_RANK_ERROR
    assert not (tmp_path / "run").exists()


def test_why_fairscale_fsdp_with_one_rank_cannot_checkpoint():
    """The failure the refusal prevents, on the CPU: a one-rank group, one FSDP unit, one optimizer step, then the
    checkpoint's gather_full_optim_state_dict. If a fairscale release fixes this, this test fails: lift the refusal."""
    pytest.importorskip("fairscale")
    import torch.distributed as dist
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = FSDP(nn.Linear(4, 3), compute_device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        assert not any(p._is_sharded for p in model.params)  # one rank: nothing is sharded ...
        with pytest.raises(AttributeError, match="_full_param_padded"):  # ... and the gather needs the shard buffer
            model.gather_full_optim_state_dict(optimizer)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the cnn's pooling
def _reference_cnn(model: SmallCNN) -> SmallCNN:
    """The cnn as it was: nn.AdaptiveAvgPool2d(2) where AvgPoolTo2x2 is now."""
    reference = copy.deepcopy(model)
    assert isinstance(reference.features[-1], AvgPoolTo2x2)
    reference.features[-1] = nn.AdaptiveAvgPool2d(2)
    return reference


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32), (3, 10, 10)],
                         ids=["digits", "mnist", "cifar10", "odd-map"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cnn_is_unchanged_on_the_cpu(shape, dtype):
    """Same parameters, same initial weights, bitwise the same outputs and gradients as with AdaptiveAvgPool2d."""
    torch.manual_seed(0)
    model = SmallCNN(shape[0], 10).to(dtype)
    reference = _reference_cnn(model)
    assert [(k, v.shape) for k, v in model.state_dict().items()] == \
        [(k, v.shape) for k, v in reference.state_dict().items()]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    x = torch.randn(6, *shape, dtype=dtype)
    grads = []
    for m in (model, reference):
        out = m(x)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad for p in m.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def test_the_cnn_is_unchanged_under_cpu_autocast():
    torch.manual_seed(0)
    model = SmallCNN(1, 10)
    reference = _reference_cnn(model)
    x = torch.randn(4, 1, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("side", [4, 14, 16])
def test_the_cuda_branch_takes_the_same_averages(side):
    """What AvgPoolTo2x2 runs on CUDA (avg_pool2d, kernel = stride = half the side), on CPU tensors: the adaptive
    windows exactly, up to the order of one division (sum / h / w there, sum / (h * w) here): bitwise where the
    window's sides are powers of two, within an ulp otherwise."""
    x = torch.randn(3, 5, side, side, dtype=torch.float64)
    tiles, adaptive = F.avg_pool2d(x, side // 2), F.adaptive_avg_pool2d(x, 2)
    torch.testing.assert_close(tiles, adaptive, rtol=4e-16, atol=0)
    if side // 2 in (2, 8):
        assert torch.equal(tiles, adaptive)


# ---------------------------------------------------------------------- every run starts its own CUDA peak
def test_the_run_start_resets_every_used_gpus_peak(monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    runtime.set_deterministic(False)
    assert resets == []  # CUDA not initialised: nothing was allocated, and no device gets a context
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    runtime.set_deterministic(False)
    assert resets == [0, 1]


@pytest.mark.parametrize("loop", ["single", "data_parallel", "model_parallel", "hybrid", "ddp", "zero"])
def test_every_loop_starts_with_set_deterministic_once(loop):
    """set_deterministic is where a run's peak-memory count starts: each loop must call it once, at set-up."""
    source = (REPO / "manual_train" / "loops" / f"{loop}.py").read_text()
    calls = re.findall(r"^    set_deterministic\(cfg\.deterministic\)$", source, flags=re.M)
    assert len(calls) == 1 and source.count("set_deterministic(") == 1, loop
    assert source.index("set_deterministic(cfg.deterministic)") < source.index("build_model_from(")


# ---------------------------------------------------------------------- one GPU, named twice
def test_model_parallelism_on_one_gpu_passes_validation(tmp_path, one_gpu_machine):
    cfg = make_cfg(tmp_path, model_parallel.ModelParallelConfig, dataset="reverse", model="seq2seq", devices="cuda:0,cuda:0")
    assert cfg.device_list() == [torch.device("cuda:0")] * 2
    auto = make_cfg(tmp_path, model_parallel.ModelParallelConfig, dataset="reverse", model="seq2seq")
    assert auto.device_list() == [torch.device("cuda:0")] * 2  # auto on one GPU: both halves on it


def test_hybrid_dp_mp_on_one_gpu_passes_validation(tmp_path, one_gpu_machine, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for impl in ("torch", "explicit"):
        cfg = make_cfg(tmp_path, hybrid.HybridConfig, dataset="reverse", model="seq2seq", mode="dp-mp",
                       devices="cuda:0,cuda:0", impl=impl)
        assert cfg.device_groups(read_env()) == ([torch.device("cuda:0")], [torch.device("cuda:0")])


# ---------------------------------------------------------------------- scripts/gpu_check.sh
def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the CPU does with the CUDA-only entries")
def test_gpu_check_runs_registered_entries_and_the_new_ones_skip_cleanly_on_the_cpu():
    """BENCH_ONLY names only registered entries (CUDA graphs, TF32, compile + bf16 MFU among them); the new
    children walk on the CPU without compiling (CUDA graphs: eager only) or TF32 (which the CPU ignores: no
    deviation). (Without CUDA the suite itself refuses in one line: tests/test_bench.py.)"""
    from manual_train.bench import gpu

    default = re.search(r"BENCH_ONLY=\$\{BENCH_ONLY:-([a-z0-9_,]+)\}", GPU_CHECK.read_text()).group(1).split(",")
    assert set(default) <= set(gpu.ENTRIES) and {"cuda_graphs", "tf32", "gpt_compile_mfu"} <= set(default), default
    tiny = dict(vocab=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    graphs = gpu._cuda_graphs_child(tiny, batch_size=2, warmup=1, steps=1, rounds=1, device="cpu")
    assert list(graphs["step_s"]) == ["eager"]
    tf32 = gpu._tf32_child(tiny, batch_size=2, steps=2, rounds=1, device="cpu")
    assert tf32["logit_deviation"] == tf32["weight_deviation"] == 0.0 and not torch.backends.cuda.matmul.allow_tf32


def _summarize(tmp_path: Path, log: str, rc: int) -> subprocess.CompletedProcess:
    path = tmp_path / "pytest-gpu.log"
    path.write_text(log)
    return subprocess.run(["bash", str(GPU_CHECK), "--summarize", str(path), str(rc)], capture_output=True,
                          text=True, timeout=60)


ONE_GPU_LOG = """\
tests/test_bench.py::test_logging_idioms_sync_counts_on_cuda PASSED                  [  4%]
tests/test_data_parallel.py::test_gpu_dp_equals_single_gpu[torch] SKIPPED (needs 2 CUDA device(s)) [ 40%]
tests/test_zero_gpu.py::TestOneGPU::test_fsdp2 FAILED                                [ 90%]
=================================== FAILURES ===================================
E   AssertionError: 0.1 > 0.05
=========================== short test summary info ============================
SKIPPED [11] tests/conftest.py:63: needs 2 CUDA device(s)
SKIPPED [3] tests/conftest.py:63: needs 4 CUDA device(s)
SKIPPED [1] tests/test_precision.py:230: could not import 'apex.amp': No module named 'apex'
SKIPPED [2] tests/test_zero_gpu.py:24: fairscale is not installed (pip install -e '.[zero]')
FAILED tests/test_zero_gpu.py::TestOneGPU::test_fsdp2 - AssertionError: 0.1 > 0.05
ERROR tests/test_one_gpu.py::test_x - RuntimeError: CUDA error
===== 1 failed, 12 passed, 17 skipped, 601 deselected, 1 error in 131.52s (0:02:11) =====
"""


def test_gpu_check_counts_what_ran_and_why_the_rest_skipped(tmp_path):
    proc = _summarize(tmp_path, ONE_GPU_LOG, 1)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "tests: FAILED: of 31 GPU tests 14 ran (12 passed, 1 failed, 1 errors), 17 skipped"
    assert lines[1:] == ["  skipped 11: needs 2 CUDA device(s)",
                         "  skipped 3: needs 4 CUDA device(s)",
                         "  skipped 2: fairscale is not installed (pip install -e '.[zero]')",
                         "  skipped 1: could not import 'apex.amp': No module named 'apex'",
                         "  failed: tests/test_zero_gpu.py::TestOneGPU::test_fsdp2 - AssertionError: 0.1 > 0.05",
                         "  error: tests/test_one_gpu.py::test_x - RuntimeError: CUDA error"]


def test_gpu_check_says_passed_only_with_the_counts(tmp_path):
    log = ("SKIPPED [14] tests/conftest.py:63: needs 2 CUDA device(s)\n"
           "========== 10 passed, 14 skipped, 600 deselected in 95.02s (0:01:35) ==========\n")
    proc = _summarize(tmp_path, log, 0)
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ["tests: passed: of 24 GPU tests 10 ran (10 passed), 14 skipped",
                                        "  skipped 14: needs 2 CUDA device(s)"]


def test_gpu_check_fails_when_every_gpu_test_skipped(tmp_path):
    """On a GPU machine the one-GPU tests must run: all of them skipping means pytest saw no CUDA."""
    log = ("SKIPPED [9] tests/conftest.py:63: needs 1 CUDA device(s)\n"
           "========== 9 skipped, 600 deselected in 5.02s ==========\n")
    proc = _summarize(tmp_path, log, 0)
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["tests: NONE RAN: of 9 GPU tests 0 ran (0 passed), 9 skipped",
                                        "  skipped 9: needs 1 CUDA device(s)"]


def test_gpu_check_reports_a_time_out_and_what_had_finished(tmp_path):
    log = ("tests/test_a.py::test_one PASSED                [ 10%]\n"
           "tests/test_a.py::test_two SKIPPED (needs 2 CUDA device(s)) [ 20%]\n"
           "tests/test_a.py::test_three PASSED              [ 30%]\n")
    proc = _summarize(tmp_path, log, 124)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == ("tests: STOPPED by the time limit after 2 passed, 0 failed, 0 errors, "
                                           "1 skipped (no summary line)")


def test_gpu_check_fails_when_nothing_was_selected(tmp_path):
    """A GPU check that checked nothing is not a pass (it exited 0 here before)."""
    proc = _summarize(tmp_path, "========== 620 deselected in 3.1s ==========\n", 5)
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "tests: NONE SELECTED: pytest -m gpu selected no GPU-marked test (pytest exit 5): nothing was checked"]


# ---------------------------------------------------------------------- the torch versions claimed
def test_setup_cfg_and_readme_claim_the_same_torch_range():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requires = setup["options"]["install_requires"]
    low = re.search(r"^torch>=([\d.]+)$", requires, flags=re.M).group(1)
    requirements = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"torch >= {low}" in requirements
    installed = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= tuple(int(p) for p in low.split(".")[:2])
