"""16-bit precision: the loss scaler, skipped steps, the hand-written O2, trajectories against 32-true,
checkpoint round-trips, and the apex-o2 error. CUDA versions are marked gpu."""
from __future__ import annotations

import csv

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import make_cfg, max_param_diff, needs_cuda

from manual_train.config import Config
from manual_train.loops import single
from manual_train.precision import DynamicLossScaler, Precision


# ---------------------------------------------------------------------- the dynamic loss scaler alone
def test_overflow_halves_the_scale_and_resets_the_count():
    s = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=3)
    s.update(found_inf=False)
    s.update(found_inf=False)
    s.update(found_inf=True)
    assert s.scale == 2.0 ** 15 and s.clean_steps == 0


def test_growth_after_the_interval_and_the_cap():
    s = DynamicLossScaler(init_scale=2.0 ** 22, growth_interval=2, max_scale=2.0 ** 24)
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0 ** 23
    for _ in range(10):
        s.update(False)
    assert s.scale == 2.0 ** 24  # capped, as apex caps at 2**24


def test_scaler_state_round_trip():
    a = DynamicLossScaler(growth_interval=5)
    for found in (False, False, True, False):
        a.update(found)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert (b.scale, b.clean_steps) == (a.scale, a.clean_steps) == (2.0 ** 15, 1)


# ---------------------------------------------------------------------- an overflow in a real step
@pytest.mark.parametrize("precision", ["16-mixed", "16-o2"])
def test_injected_inf_skips_the_step_and_the_scheduler(tmp_path, monkeypatch, precision):
    """At the 5th optimizer step one gradient is set to inf. That step must leave the weights as
    they were, not advance the LR schedule, halve the loss scale, and be counted in summary.json."""
    real_unscale, real_step = Precision.unscale_, Precision.step
    windows, checks = [], []

    def unscale_with_inf(self, optimizer):
        windows.append(1)
        if len(windows) == 5:
            grads = [p.grad for p in (self.model_params or optimizer.param_groups[0]["params"]) if p.grad is not None]
            grads[0].view(-1)[0] = float("inf")
        real_unscale(self, optimizer)

    def step_and_check(self, optimizer):
        before = [p.detach().clone() for p in optimizer.param_groups[0]["params"]]
        stepped = real_step(self, optimizer)
        same = all(torch.equal(b, p) for b, p in zip(before, optimizer.param_groups[0]["params"]))
        checks.append((stepped, same))
        return stepped

    monkeypatch.setattr(Precision, "unscale_", unscale_with_inf)
    monkeypatch.setattr(Precision, "step", step_and_check)
    summary = single.train(make_cfg(tmp_path, precision=precision, model="mlp", max_steps=8, log_every=1))
    assert [s for s, _ in checks] == [True] * 4 + [False] + [True] * 3
    assert checks[4][1] is True and not any(same for _, same in checks[:4])  # unchanged only when skipped
    assert summary["skipped_steps"] == 1 and summary["optimizer_steps"] == 8
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert ckpt["scheduler"]["last_epoch"] == 7  # 8 steps, one skipped: the schedule advanced 7 times
    scale = ckpt["scaler"]["scaler"]["scale"]
    assert float(scale) == 2.0 ** 15


# ---------------------------------------------------------------------- the hand-written O2
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def test_o2_invariants_hold_after_every_step(tmp_path):
    cfg = make_cfg(tmp_path, precision="16-o2")
    torch.manual_seed(0)
    raw = ConvBN()
    amp = Precision(cfg, torch.device("cpu"))
    model, params = amp.prepare(raw)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert raw.bn.weight.dtype == raw.bn.bias.dtype == raw.bn.running_var.dtype == torch.float32
    assert raw.conv.weight.dtype == raw.fc.weight.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in optimizer.param_groups[0]["params"])
    assert optimizer.param_groups[0]["params"] == amp.master_params
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    for _ in range(5):
        logits = model(x)
        assert logits.dtype == torch.float32  # outputs come back in fp32 for the loss
        amp.backward(F.cross_entropy(logits, y), optimizer, True)
        amp.unscale_(optimizer)
        assert all(m.grad.dtype == torch.float32 for m in amp.master_params)
        assert all(p.grad is None for p in amp.model_params)  # consumed into the masters
        assert amp.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        for p, m in zip(amp.model_params, amp.master_params):
            assert torch.equal(p.detach(), m.detach().to(p.dtype))  # the model is the masters, rounded
    state = amp.model_state_dict(raw)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert torch.equal(state["conv.weight"], amp.master_params[0].detach())


def test_o2_equals_native_fp16_autocast_without_batchnorm(tmp_path):
    """With no BatchNorm, O2's fp16 model computes the ops autocast(float16) computes, on the same
    rounded weights, and both step fp32 weights: the two trajectories agree to rounding."""
    a = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "amp"), precision="16-mixed", model="mlp",
                              max_steps=40))
    b = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "o2"), precision="16-o2", model="mlp",
                              max_steps=40))
    wa = torch.load(tmp_path / "amp" / "last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "o2" / "last.pt", weights_only=True)["model"]
    assert max_param_diff(wa, wb) < 1e-6 and a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-5)


# ---------------------------------------------------------------------- trajectories against 32-true
def train_losses(tmp_path, precision, steps=120, model="mlp"):
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / precision), precision=precision, model=model,
                          max_steps=steps, log_every=1))
    with open(tmp_path / precision / "metrics.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


# Measured on this project's 2-core CPU (2026-11-29), mlp on digits, 120 steps (loss 2.3 -> 0.2):
# max |loss - loss_32| per step = 0.0094 for bf16-mixed, 0.0063 for 16-mixed and 16-o2.
# Tolerances are ~5x that: bf16 keeps 8 mantissa bits, fp16 11, so bf16 drifts further.
TRAJECTORY_TOLERANCE = {"bf16-mixed": 0.05, "16-mixed": 0.03, "16-o2": 0.03}


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    return train_losses(tmp_path_factory.mktemp("fp32"), "32-true")


@pytest.mark.parametrize("precision", list(TRAJECTORY_TOLERANCE))
def test_training_loss_tracks_32_true(tmp_path, fp32_losses, precision):
    losses = train_losses(tmp_path, precision)
    assert len(losses) == len(fp32_losses) == 120
    assert fp32_losses[-1] < 0.5 * fp32_losses[0]  # the window covers real learning, not a plateau
    worst = max(abs(a - b) for a, b in zip(losses, fp32_losses))
    assert worst < TRAJECTORY_TOLERANCE[precision], worst


def test_the_trajectory_check_can_fail(tmp_path, fp32_losses):
    """A different learning rate is a different trajectory: the same tolerance rejects it."""
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "lr"), model="mlp", lr=0.04, max_steps=120,
                          log_every=1))
    with open(tmp_path / "lr" / "metrics.csv", newline="") as f:
        other = [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]
    assert max(abs(a - b) for a, b in zip(other, fp32_losses)) > TRAJECTORY_TOLERANCE["bf16-mixed"]


@pytest.mark.slow
def test_full_run_accuracy_within_2_points_of_32_true(tmp_path):
    """The default schedule (10 epochs of digits) in bf16-mixed and 16-o2 ends within 2 accuracy points of
    32-true. The mlp stands in for the default cnn here: fp16 convolutions have no fast kernel on this CPU
    (aten::_slow_conv2d, ~10x fp32), which would cost minutes; docs/precision.md records the cnn run."""
    acc = {p: single.train(make_cfg(tmp_path, out_dir=str(tmp_path / p), precision=p, model="mlp"))["final_val_acc"]
           for p in ("32-true", "bf16-mixed", "16-o2")}
    assert acc["32-true"] >= 0.95
    assert abs(acc["bf16-mixed"] - acc["32-true"]) <= 0.02 and abs(acc["16-o2"] - acc["32-true"]) <= 0.02, acc


# ---------------------------------------------------------------------- checkpoints continue the same scale
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-o2"])
def test_checkpoint_round_trip_continues_the_same_run(tmp_path, precision):
    """12 steps, stop, resume to 20 == 20 steps straight: weights bitwise, and the same loss-scaler state
    (growth every 5 clean steps, so the scale changes before and after the resume point)."""
    flags = dict(precision=precision, model="mlp", schedule="constant", loss_scale_growth_interval=5)
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "straight"), max_steps=20, **flags))
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "part"), max_steps=12, **flags))
    mid = torch.load(tmp_path / "part" / "last.pt", weights_only=True)
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "resumed"), max_steps=20,
                          resume=str(tmp_path / "part" / "last.pt"), **flags))
    a = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["scaler"] == b["scaler"]
    if precision != "bf16-mixed":
        assert float(mid["scaler"]["scaler"]["scale"]) == 2.0 ** 18  # grew at steps 5 and 10
        assert b["scaler"]["scaler"] != mid["scaler"]["scaler"]  # it kept evolving after the resume, identically
    else:
        assert b["scaler"]["scaler"] == {}  # bf16 needs no loss scaling


def test_apex_o2_without_apex_is_a_one_line_error(tmp_path):
    from conftest import run_script

    proc = run_script("single", "--precision", "apex-o2", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "apex.amp" in err[0] and "16-o2" in err[0]


# ---------------------------------------------------------------------- CUDA (run by scripts/gpu_check.sh)
@needs_cuda(1)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "16-o2"])
def test_cuda_trajectory_tracks_32_true(tmp_path, precision):
    ref = train_losses(tmp_path / "ref", "32-true")
    losses = train_losses(tmp_path, precision)
    assert max(abs(a - b) for a, b in zip(losses, ref)) < TRAJECTORY_TOLERANCE[precision]


@needs_cuda(1)
def test_cuda_o2_keeps_batchnorm_fp32_on_resnet18(tmp_path):
    summary = single.train(make_cfg(tmp_path, precision="16-o2", model="resnet18", dataset="synthetic",
                                    synthetic_size=512, max_steps=20, device="cuda"))
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert summary["optimizer_steps"] == 20
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())


@needs_cuda(1)
def test_cuda_apex_o2_when_apex_is_importable(tmp_path):
    pytest.importorskip("apex.amp")
    o2 = train_losses(tmp_path / "o2", "16-o2", steps=60)
    apex = train_losses(tmp_path / "apex", "apex-o2", steps=60)
    assert max(abs(a - b) for a, b in zip(o2, apex)) < TRAJECTORY_TOLERANCE["16-o2"]


# ---------------------------------------------------------------------- 64-true, the parity mode
def test_64_true_is_32_true_upcast_and_stays_float64(tmp_path, monkeypatch):
    """64-true starts from 32-true's initial weights (built in fp32, upcast exactly), feeds the model float64
    inputs, keeps float64 optimizer state and checkpoints float64 weights; one step then differs from 32-true
    by rounding only."""
    seen = {}
    real_prepare = Precision.prepare

    def recording_prepare(self, model):
        seen[self.name] = {k: v.clone() for k, v in model.state_dict().items()}  # the weights before step 1
        return real_prepare(self, model)

    monkeypatch.setattr(Precision, "prepare", recording_prepare)
    flags = dict(model="mlp", max_steps=1, batch_size=32)
    single.train(make_cfg(tmp_path / "a", precision="32-true", out_dir=str(tmp_path / "a"), **flags))
    single.train(make_cfg(tmp_path / "b", precision="64-true", out_dir=str(tmp_path / "b"), **flags))
    assert all(v.dtype == torch.float64 for v in seen["64-true"].values())
    assert all(torch.equal(seen["64-true"][k], seen["32-true"][k].double()) for k in seen["32-true"])
    b = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    a = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    assert all(v.dtype == torch.float64 for v in b["model"].values())
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in b["optimizer"]["state"].values())
    assert 0 < max_param_diff(a["model"], b["model"]) < 1e-6  # the same step, rounded in fp32 vs float64


def test_64_true_casts_floating_inputs_and_passes_token_ids():
    amp = Precision(Config(precision="64-true"), torch.device("cpu"))
    model, params = amp.prepare(nn.Linear(4, 2))
    assert all(p.dtype == torch.float64 for p in params)
    assert model(torch.ones(3, 4)).dtype == torch.float64  # fp32 images become float64 on the way in
    emb, _ = amp.prepare(nn.Embedding(10, 3))
    assert emb(torch.tensor([1, 2])).dtype == torch.float64  # int64 token ids pass unchanged
