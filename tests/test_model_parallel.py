"""Model parallelism (launch/model_parallel.py, manual_train/loops/model_parallel.py, manual_train/model_parallel.py).

Parity with `--devices cpu,cpu`, proven in 64-true (float64; docs/parity.md) within PARITY_TOL_64 = 1e-9: the split
model computes the one-device model's outputs and gradients, with and without micro-batches, and its loop trains the
baseline's weights over two epochs of the reverse task (SEQ_PARITY: conftest.SEQ's settings, 205 samples so that
each epoch ends in a batch of 5, cut into micro-batches 2 + 2 + 1; 42 SGD steps). Two epochs instead of SEQ's 6
steps because they are cheap (a run takes about 1 s here, in float64 as in fp32) and cross an epoch boundary and a
partial batch. The known-wrong variant hits the technique's own code: split_encoder_decoder with the encoder's hidden
state crossing to the decoder's device detached (backward stops at the hop; the encoder never trains) fails the same
check; the catalogue's model-parallel mutants (tests/mutants/model_parallel.py: the micro-batches' mean losses
averaged, the hops detached, the halves copied, the schedule without its drain) fail these tests. The fp32 pairing
(seq2seq, M = 3, the same horizon) is held to a noise floor measured in the same test (conftest.fp32_noise_floor).
Measured 2026-12-01 (2-core Xeon VM, AVX-512, torch 2.14.1): 64-true M = 1 0.0, M = 3 4.4e-16; fp32 M = 3 2.4e-7
against a floor of 4.8e-7; 2026-12-02: the detached hop 0.19 (64-true and fp32). The fill-drain schedule and its
bubble arithmetic are checked against each other.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import (FP32_MODEL, PARITY_TOL_64, SEQ, assert_cross_path_64, assert_resumes_not_reruns,
                      assert_within_fp32_floor, cuda_devices, fp32_noise_floor, max_param_diff, run_script, train_state)
from manual_train.cli import run as cli_run
from manual_train.config import Config
from manual_train.data import ReverseDigits
from manual_train.loops import model_parallel, single
from manual_train.metrics import CSV_COLUMNS, SUMMARY_KEYS
from manual_train.model_parallel import bubble_fraction, fill_drain_schedule, split_encoder_decoder
from manual_train.models import Seq2Seq, loss_fn

CPU = torch.device("cpu")
# The parity horizon: SEQ's model, task, optimizer and batch, for two epochs of 205 samples (20 batches of 10 and one
# of 5 an epoch: 42 steps; 51 validation samples), in 64-true. test_hybrid.py uses it too.
SEQ_PARITY = dict(SEQ, synthetic_size=205, max_steps=None, epochs=2, log_every=7, precision="64-true")
SEQ_FP32 = dict(SEQ_PARITY, precision="32-true")  # the fp32 pairing: the same run in fp32 (FP32_MODEL is for images)
assert FP32_MODEL != SEQ["model"]  # (the seq2seq tests keep their model in fp32)


real_split_encoder_decoder = split_encoder_decoder


class Detached(torch.nn.Module):
    """A module whose output leaves autograd's graph (h.detach(), or a copy rebuilt from its values)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args).detach()


def split_with_a_detached_hop(model, devices, microbatches=1):
    """The known-wrong variant of split_encoder_decoder (the technique's own code): the encoder's hidden state
    crosses to the decoder's device detached, as `h.detach().to(B)` or a tensor rebuilt on B would, so backward stops
    at the hop: the decoder trains, the encoder keeps its initial weights."""
    split = real_split_encoder_decoder(model, devices, microbatches)
    split.encoder = Detached(split.encoder)
    return split


def batch(n=10):
    data = ReverseDigits(n, seed=3)
    return data.x, data.y


def outputs_and_grads(model, forward, x, y):
    model.zero_grad(set_to_none=True)
    logits = forward(x)
    loss_fn(logits, y.to(logits.device)).backward()
    return logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------- the split module
@pytest.mark.parametrize("microbatches", [1, 3])
def test_split_equals_one_device(microbatches):
    """Outputs and gradients of the split model (cpu,cpu) equal the model's own, micro-batched (4, 4, 2) or not
    (float64: within 1e-9 on any CPU)."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB).double()
    reference = copy.deepcopy(model)
    x, y = batch(10)
    split = split_encoder_decoder(model, [CPU, CPU], microbatches)
    assert split.encoder is model.encoder and split.decoder is model.decoder  # no copies: the model's own weights
    out, grads = outputs_and_grads(model, split, x, y)
    ref_out, ref_grads = outputs_and_grads(reference, reference, x, y)
    assert (out - ref_out).abs().max() <= PARITY_TOL_64
    assert max_diff(grads, ref_grads) <= PARITY_TOL_64


def test_microbatch_losses_need_weighting():
    """Why the pipeline concatenates the micro-batches' logits before one loss: averaging the micro-batches'
    mean losses (tensor.chunk's sizes 4, 4, 2) gives another gradient; weighting each by its share does not."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB).double()  # float64: the identity holds to 1e-9 on any CPU
    x, y = batch(10)
    _, full = outputs_and_grads(model, model, x, y)

    def grads(weights):
        model.zero_grad(set_to_none=True)
        sum(w * loss_fn(model(xc), yc) for w, xc, yc in zip(weights, x.chunk(3), y.chunk(3))).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    assert max_diff(grads([4 / 10, 4 / 10, 2 / 10]), full) <= PARITY_TOL_64
    assert max_diff(grads([1 / 3] * 3), full) > 1e-4


def test_fill_drain_schedule_and_bubble():
    assert fill_drain_schedule(2, 3) == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    for stages in (2, 3, 4):
        for micro in (1, 2, 4, 8):
            clocks = fill_drain_schedule(stages, micro)
            runs = [(s, m, t) for t, clock in enumerate(clocks) for s, m in clock]
            assert sorted((s, m) for s, m, _ in runs) == [(s, m) for s in range(stages) for m in range(micro)]
            assert all(t == s + m for s, m, t in runs)  # stage s takes micro-batch m right after stage s-1
            idle = stages * len(clocks) - len(runs)
            assert idle / (stages * len(clocks)) == pytest.approx(bubble_fraction(stages, micro))
            assert bubble_fraction(stages, micro) == pytest.approx((stages - 1) / (micro + stages - 1))


def test_forward_issues_the_schedule():
    """The split's forward calls encoder and decoder in the schedule's order (later stage first in a clock)."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB)
    calls = []
    model.encoder.register_forward_pre_hook(lambda mod, args: calls.append((0, len(args[0]))))
    model.decoder.register_forward_pre_hook(lambda mod, args: calls.append((1, len(args[0]))))
    split_encoder_decoder(model, [CPU, CPU], microbatches=3)(batch(10)[0])
    sizes = [4, 4, 2]  # tensor.chunk: ceil(10 / 3) rows each, the rest last
    assert calls == [(s, sizes[m]) for clock in fill_drain_schedule(2, 3) for s, m in reversed(clock)]


# ---------------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The single-device loop over the parity horizon, 64-true."""
    return train_state(single, Config, tmp_path_factory.mktemp("single"), "s", **SEQ_PARITY)


def train_mp(tmp_path, name, microbatches, **flags):
    return train_state(model_parallel, model_parallel.ModelParallelConfig, tmp_path, name, devices="cpu,cpu",
                       microbatches=microbatches, **flags)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_mp_loop_equals_baseline(tmp_path, baseline, microbatches):
    """64-true, two epochs: within 1e-9 of the single-device loop (measured: M = 1 0.0, M = 3 4.4e-16)."""
    base, base_summary = baseline
    state, summary = train_mp(tmp_path, "mp", microbatches, **SEQ_PARITY)
    assert_cross_path_64(state, base, f"split, M = {microbatches}, vs one device")  # float64 tensors, within 1e-9
    assert summary["optimizer_steps"] == base_summary["optimizer_steps"] == 42
    assert summary["final_val_loss"] == pytest.approx(base_summary["final_val_loss"], rel=1e-9)
    assert summary["bubble_fraction"] == pytest.approx(1 / (microbatches + 1))


def test_a_detached_hop_fails_the_same_check(tmp_path, baseline, monkeypatch):
    """The split with the encoder's hidden state crossing detached (M = 3): the encoder never trains, far outside
    1e-9."""
    monkeypatch.setattr(model_parallel, "split_encoder_decoder", split_with_a_detached_hop)
    wrong, _ = train_mp(tmp_path, "wrong", 3, **SEQ_PARITY)
    print(f"a detached hop vs one device: {max_param_diff(baseline[0], wrong):.3g}")
    assert max_param_diff(baseline[0], wrong) > 1e6 * PARITY_TOL_64


def test_fp32_mp_within_the_noise_floor_and_a_detached_hop_is_not(tmp_path, monkeypatch):
    """fp32 (seq2seq, M = 3, two epochs): within 10 one-ulp drifts of the baseline; a detached hop is not."""
    base, _ = train_state(single, Config, tmp_path, "single", **SEQ_FP32)
    floor = fp32_noise_floor(lambda name: train_state(single, Config, tmp_path, name, **SEQ_FP32)[0], base)
    state, _ = train_mp(tmp_path, "mp", 3, **SEQ_FP32)
    assert_within_fp32_floor(max_param_diff(base, state), floor, "split, M = 3, vs one device")
    monkeypatch.setattr(model_parallel, "split_encoder_decoder", split_with_a_detached_hop)
    wrong, _ = train_mp(tmp_path, "wrong", 3, **SEQ_FP32)
    with pytest.raises(AssertionError):
        assert_within_fp32_floor(max_param_diff(base, wrong), floor, "a detached hop vs one device")


def test_resume_continues_exactly(tmp_path):
    """3 steps, then --resume auto on to 6: the weights of 6 steps straight, and the resumed call trains only the 3
    remaining batches, the straight run's last 3; a rerun from scratch (--resume ignored) trains all 6 (test_data_parallel.py)."""
    common = dict(SEQ, microbatches=2, schedule="constant")
    assert_resumes_not_reruns(tmp_path, model_parallel, model_parallel.ModelParallelConfig, **common)


# ---------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(tmp_path, capsys):
    from test_data_parallel import cuda_missing_line

    cases = [
        (["--devices", "cpu"], "error: --devices: 1 device(s) given; model parallelism (encoder device, decoder "
                               "device) needs exactly 2 (allowed: a comma list of cpu and cuda:N, e.g. cpu,cpu or "
                               "cuda:0,cuda:1)"),
        (["--devices", "cpu,npu:0"], "error: --devices: unknown device 'npu:0' (allowed: cpu, cuda:N)"),
        (["--devices", "cuda:0,cuda:9"], cuda_missing_line("--devices", "cuda:0, cuda:9", 9)),
        (["--microbatches", "33"], "error: --microbatches: 33 micro-batches cannot be cut from a batch of 32 "
                                   "(allowed: <= --batch-size (32))"),
        (["--microbatches", "0"], "error: --microbatches: 0 is out of range (allowed: >= 1)"),
        (["--dataset", "digits", "--model", "cnn"], "error: --model: model parallelism splits seq2seq's encoder and "
                                                    "decoder; cnn has no such halves (allowed: seq2seq (with "
                                                    "--dataset reverse))"),
    ]
    for argv, line in cases:
        out_dir = tmp_path / "never"
        rc = cli_run(model_parallel.train, model_parallel.ModelParallelConfig, script="model_parallel",
                     argv=argv + ["--out-dir", str(out_dir)], **model_parallel.DEFAULTS)
        assert (rc, capsys.readouterr().err) == (2, line + "\n"), argv
        assert not out_dir.exists()


# ---------------------------------------------------------------------- the script as a user runs it
def test_script_defaults_and_outputs(tmp_path):
    """launch/model_parallel.py defaults to the reverse task (adamw) and writes the outputs contract."""
    out_dir = tmp_path / "run"
    result = run_script("model_parallel", "--synthetic-size", "64", "--microbatches", "2", "--max-steps", "2", "--no-progress",
                        "--out-dir", str(out_dir))
    assert result.returncode == 0, result.stderr
    assert "encoder on cpu, decoder on cpu; 2 micro-batch(es) of [16, 16]" in result.stdout
    assert (out_dir / "metrics.csv").read_text().splitlines()[0].split(",") == list(CSV_COLUMNS)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= summary.keys() and summary["bubble_fraction"] == pytest.approx(1 / 3)
    ckpt = torch.load(out_dir / "best.pt", map_location="cpu", weights_only=True)
    assert {k: ckpt["config"][k] for k in model_parallel.DEFAULTS if k != "synthetic_size"} == \
        {k: v for k, v in model_parallel.DEFAULTS.items() if k != "synthetic_size"}
    assert torch.load(out_dir / "last.pt", map_location="cpu", weights_only=True)["step"] == 2


# ---------------------------------------------------------------------- GPUs
@pytest.mark.parametrize("microbatches", [pytest.param(m, marks=cuda_devices(2)) for m in (1, 4)])
def test_gpu_split_equals_one_gpu(microbatches):
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB)
    reference = copy.deepcopy(model).to(devices[0])
    x, y = batch(32)
    split = split_encoder_decoder(model, devices, microbatches)
    assert {p.device for p in model.encoder.parameters()} == {devices[0]}
    assert {p.device for p in model.decoder.parameters()} == {devices[1]}
    out, grads = outputs_and_grads(model, split, x, y)
    ref_out, ref_grads = outputs_and_grads(reference, reference, x.to(devices[0]), y)
    assert (out - ref_out).abs().max() < 1e-5 and max_diff(grads, ref_grads) < 1e-5  # cuDNN GRU rounding
