"""Data parallelism in one process (launch/dp.py, manual_train/loops/data_parallel.py, manual_train/parallel.py).

Parity: the explicit replicate/scatter/parallel_apply/gather over 2 and 3 CPU chunks trains the baseline's
weights; nn.DataParallel on a host without CUDA is the plain module. Wrong variants show the checks can fail.
Also: the teach-by-diff markers of all three single-process-parallel loops, bad input, the outputs contract.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import load_model_state, make_cfg, max_param_diff, needs_cuda, run_script, train_state
from manual_train import parallel
from manual_train.checkpoint import REQUIRED_KEYS
from manual_train.cli import run as cli_run
from manual_train.config import Config
from manual_train.data import load_digits_split
from manual_train.loops import data_parallel, single
from manual_train.metrics import CSV_COLUMNS, SUMMARY_KEYS
from manual_train.models import SmallCNN, loss_fn

CPU = torch.device("cpu")
STEPS = dict(max_steps=6, log_every=2)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The single-device loop's weights, per (batch size, accumulate), computed once per module."""
    cache = {}

    def get(batch_size, accumulate):
        if (batch_size, accumulate) not in cache:
            cache[batch_size, accumulate] = train_state(single, Config, tmp_path_factory.mktemp("single"), "s",
                                                        batch_size=batch_size, accumulate=accumulate, **STEPS)
        return cache[batch_size, accumulate]
    return get


# ---------------------------------------------------------------------- parity
@pytest.mark.parametrize("devices,batch_size,accumulate", [
    ("cpu,cpu", 32, 1),  # two chunks of 16
    ("cpu,cpu,cpu", 10, 2),  # three unequal chunks (4, 4, 2), two micro-batches per step
])
def test_explicit_dp_equals_baseline(tmp_path, baselines, devices, batch_size, accumulate):
    base, base_summary = baselines(batch_size, accumulate)
    state, summary = train_state(data_parallel, data_parallel.DPConfig, tmp_path, "dp", impl="explicit",
                                 devices=devices, batch_size=batch_size, accumulate=accumulate, **STEPS)
    assert max_param_diff(base, state) < 1e-6
    assert summary["final_val_loss"] == pytest.approx(base_summary["final_val_loss"], abs=1e-6)
    assert summary["global_batch_size"] == batch_size * accumulate and summary["devices"] == devices.split(",")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback exists only on hosts without CUDA")
def test_torch_dataparallel_on_cpu_is_the_module(tmp_path, baselines):
    """Documented in docs/data_parallel.md: without CUDA, nn.DataParallel drops device_ids and calls the module."""
    module = nn.Linear(3, 2)
    wrapped = nn.DataParallel(module, device_ids=[CPU, CPU])
    x = torch.randn(5, 3)
    assert wrapped.device_ids == [] and wrapped.module is module
    assert torch.equal(wrapped(x), module(x))
    base, _ = baselines(32, 1)
    state, _ = train_state(data_parallel, data_parallel.DPConfig, tmp_path, "dp", impl="torch",
                           devices="cpu,cpu", **STEPS)
    assert max_param_diff(base, state) == 0.0  # the same computation, bit for bit


def digits_batch(n):
    train, _ = load_digits_split()
    return train.tensors[0][:n], train.tensors[1][:n]


def grads_of(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_per_chunk_losses_need_weighting():
    """The explicit forward's gradient is the full batch's; per-chunk mean losses combined naively are not.

    Uneven chunks (10 samples over 3 devices: 4, 4, 2): averaging the chunk means over-weights the short
    chunk's samples, and summing them makes the gradient about 3x too large. One loss over the gathered
    outputs is exact, and so is weighting each chunk's mean by its share of the batch.
    """
    torch.manual_seed(0)
    model = SmallCNN(1, 10)
    x, y = digits_batch(10)
    devices = [CPU] * 3

    def grad(loss_of):
        model.zero_grad(set_to_none=True)
        loss_of().backward()
        return grads_of(model)

    full = grad(lambda: loss_fn(model(x), y))

    def gathered():
        chunks = parallel.scatter((x,), devices)
        outputs = parallel.parallel_apply(parallel.replicate(model, devices), chunks, devices)
        return loss_fn(parallel.gather(outputs, CPU), y)

    def chunk_losses():
        return [loss_fn(model(xc), yc) for xc, yc in zip(x.chunk(3), y.chunk(3))]

    assert [len(c[0]) for c in parallel.scatter((x,), devices)] == [4, 4, 2]
    assert (grad(gathered) - full).abs().max() < 1e-6
    weighted = grad(lambda: sum(l * len(yc) / len(y) for l, yc in zip(chunk_losses(), y.chunk(3))))
    assert (weighted - full).abs().max() < 1e-6
    mean_of_means = grad(lambda: sum(chunk_losses()) / 3)
    assert (mean_of_means - full).abs().max() > 1e-3 * full.abs().max()
    sum_of_means = grad(lambda: sum(chunk_losses()))
    assert (sum_of_means - full).abs().max() > 0.5 * full.abs().max()


def test_explicit_forward_with_fewer_samples_than_devices():
    """As DataParallel: a batch of 2 over 3 devices makes 2 chunks and uses 2 replicas; eval mode detaches."""
    torch.manual_seed(0)
    model = SmallCNN(1, 10)
    x, _ = digits_batch(2)
    explicit = parallel.ExplicitDataParallel(model, [CPU] * 3, CPU)
    assert len(parallel.scatter((x,), [CPU] * 3)) == 2
    assert (explicit(x) - model(x)).abs().max() < 1e-6
    with torch.no_grad():
        assert not explicit(x).requires_grad


def test_resume_continues_exactly(tmp_path):
    """--resume: 3 steps, then on to 6, gives the weights of 6 steps straight (constant LR: no schedule length)."""
    common = dict(impl="explicit", devices="cpu,cpu,cpu", batch_size=10, schedule="constant", log_every=1)
    straight, _ = train_state(data_parallel, data_parallel.DPConfig, tmp_path, "a", max_steps=6, **common)
    cfg = make_cfg(tmp_path / "b", data_parallel.DPConfig, max_steps=3, **common)
    data_parallel.train(cfg)
    resumed_cfg = make_cfg(tmp_path / "b", data_parallel.DPConfig, max_steps=6, resume="auto", **common)
    summary = data_parallel.train(resumed_cfg)
    assert summary["optimizer_steps"] == 6
    assert max_param_diff(straight, load_model_state(tmp_path / "b" / "run")) == 0.0


# ---------------------------------------------------------------------- bad input
def cuda_missing_line(flag: str, names: str, highest: int) -> str:
    """The one line for asking more CUDA devices than this host has (it depends on the host)."""
    if not torch.cuda.is_available():
        return f"error: {flag}: {names} requested but CUDA is not available on this machine (allowed: cpu,cpu)"
    have = torch.cuda.device_count()
    return (f"error: {flag}: cuda:{highest} requested but this machine has only {have} CUDA device(s) "
            f"(allowed: {', '.join(f'cuda:{i}' for i in range(have))})")


@pytest.mark.parametrize("argv,line", [
    (["--devices", "cpu,tpu"], "error: --devices: unknown device 'tpu' (allowed: cpu, cuda:N)"),
    (["--devices", "cuda,cuda"], "error: --devices: unknown device 'cuda' (name each GPU: cuda:0, cuda:1, ...) "
                                 "(allowed: cpu, cuda:N)"),
    (["--devices", "cuda:1,cuda:1"], "error: --devices: cuda:1 is listed twice; data parallelism needs distinct "
                                     "GPUs (allowed: each cuda:N once (cpu may repeat))"),
    (["--devices", "cpu,cuda:0"], "error: --devices: cpu,cuda:0 mixes cpu and cuda; data parallelism needs devices "
                                  "of one kind (allowed: all cpu or all cuda:N)"),
    (["--devices", "cuda:0,cuda:63"], None),  # more CUDA devices than this machine has
    (["--devices", "cpu,cpu", "--output-device", "tpu"], "error: --output-device: unknown device 'tpu' "
                                                         "(allowed: cpu, cuda:N)"),
    (["--devices", "cpu,cpu,cpu", "--batch-size", "2"], "error: --batch-size: 2 cannot be split over 3 devices "
                                                        "(allowed: >= 3)"),
    (["--device", "cpu"], "error: --device: dp.py places the model with --devices, not --device (allowed: auto)"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, line):
    line = line or cuda_missing_line("--devices", "cuda:0, cuda:63", 63)
    out_dir = tmp_path / "never"
    rc = cli_run(data_parallel.train, data_parallel.DPConfig, script="dp", argv=argv + ["--out-dir", str(out_dir)])
    assert (rc, capsys.readouterr().err) == (2, line + "\n")
    assert not out_dir.exists()


def test_script_bad_input_real_process(tmp_path):
    """The launch script itself: exit 2, one line on stderr, no traceback, nothing created."""
    out_dir = tmp_path / "never"
    result = run_script("dp", "--devices", "cpu,cpu,gpu", "--out-dir", str(out_dir), timeout=120)
    assert result.returncode == 2
    assert result.stderr == "error: --devices: unknown device 'gpu' (allowed: cpu, cuda:N)\n"
    assert not out_dir.exists()


# ---------------------------------------------------------------------- the outputs contract, as a user runs it
def test_script_writes_the_outputs_contract(tmp_path):
    out_dir = tmp_path / "run"
    result = run_script("dp", "--impl", "explicit", "--max-steps", "3", "--log-every", "1", "--no-progress",
                        "--out-dir", str(out_dir), timeout=180)
    assert result.returncode == 0, result.stderr
    assert "splits into chunks of [16, 16]" in result.stdout  # defaults: digits, batch 32, cpu,cpu on this host
    rows = (out_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",") == list(CSV_COLUMNS) and [r.split(",")[2] for r in rows[1:]] == ["train"] * 3 + ["val"]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= summary.keys()
    assert (summary["script"], summary["optimizer_steps"], summary["impl"]) == ("dp", 3, "explicit")
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(out_dir / name, map_location="cpu", weights_only=True)
        assert set(REQUIRED_KEYS) <= ckpt.keys() and not any(k.startswith("module.") for k in ckpt["model"])


# ---------------------------------------------------------------------- GPUs (run where >= 2 CUDA devices exist)
@pytest.mark.parametrize("impl", ["torch", "explicit"])
@needs_cuda(2)
def test_gpu_dp_equals_single_gpu(tmp_path, impl):
    """mlp (no TF32 convolutions) on digits: two GPUs, outputs gathered on cuda:1, against one GPU."""
    common = dict(model="mlp", batch_size=32, **STEPS)
    base, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **common)
    state, summary = train_state(data_parallel, data_parallel.DPConfig, tmp_path, "dp", impl=impl,
                                 devices="cuda:0,cuda:1", output_device="cuda:1", **common)
    assert max_param_diff(base, state) < 1e-5  # GPU reductions over 16 rows instead of 32 round differently
    assert set(summary["peak_mem_bytes_per_device"]) == {"cuda:0", "cuda:1"}


@needs_cuda(2)
def test_gpu_explicit_forward_is_dataparallels():
    """The four torch.nn.parallel steps give nn.DataParallel's outputs and gradients."""
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    torch.manual_seed(0)
    model = SmallCNN(1, 10).to(devices[0])
    x, y = digits_batch(32)
    grads = []
    for wrapped in (nn.DataParallel(model, device_ids=devices),
                    parallel.ExplicitDataParallel(model, devices, devices[0])):
        model.zero_grad(set_to_none=True)
        out = wrapped(x)
        loss_fn(out, y.to(devices[0])).backward()
        grads.append((out.detach(), grads_of(model)))
    assert (grads[0][0] - grads[1][0]).abs().max() < 1e-6 and (grads[0][1] - grads[1][1]).abs().max() < 1e-6
