"""apex's O2, its own lesson (loops/apex_o2.py, launch/apex_o2.py): the dynamic loss scaler, the invariants of the
fp16 model and its fp32 masters at every step of the real loop, the masters in checkpoints, parity with torch's
16-mixed, and the flags (16-o2/apex-o2 here only, apex-o2 refused in one line without apex). The trajectories,
the injected overflow and the resume round trip are in tests/test_precision.py, beside 16-mixed's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import make_cfg, max_param_diff, run_script
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from manual_train.cli import run
from manual_train.loops import apex_o2, single
from manual_train.apex_o2 import ApexO2Config, DynamicLossScaler, O2Forward, O2Masters, cast_o2
from manual_train.runtime import TrainingDiverged


# ---------------------------------------------------------------------- the dynamic loss scaler alone
def test_overflow_halves_the_scale_and_resets_the_count():
    s = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=3)
    s.update(found_inf=False)
    s.update(found_inf=False)
    s.update(found_inf=True)
    assert s.scale == s.get_scale() == 2.0 ** 15 and s.clean_steps == 0


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


# ---------------------------------------------------------------------- the fp16 model and its fp32 masters
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def test_o2_invariants_hold_at_every_step_of_the_loop(tmp_path, monkeypatch):
    """The real loop on digits with a BatchNorm model: before every optimizer step BatchNorm is fp32 and the rest
    fp16, the optimizer holds separate fp32 masters with fp32 gradients, the model's fp16 gradients were consumed,
    the model equals the masters rounded, and the loss saw fp32 logits; the checkpoint holds the final masters."""
    built, logits_dtypes, checks, masters_after = [], [], [], []
    real_loss_fn = apex_o2.loss_fn
    monkeypatch.setattr(apex_o2, "build_model_from", lambda cfg, info: built.append(ConvBN()) or built[-1])

    def recording_loss_fn(logits, y, **kw):
        if not kw:  # training's calls (evaluation's pass reduction="sum")
            logits_dtypes.append(logits.dtype)
        return real_loss_fn(logits, y, **kw)

    monkeypatch.setattr(apex_o2, "loss_fn", recording_loss_fn)

    def before_step(optimizer, args, kwargs):
        raw, masters = built[0], optimizer.param_groups[0]["params"]
        params = list(raw.parameters())
        checks.append([
            raw.bn.weight.dtype == raw.bn.bias.dtype == raw.bn.running_var.dtype == torch.float32,
            raw.conv.weight.dtype == raw.conv.bias.dtype == raw.fc.weight.dtype == torch.float16,
            all(m.dtype == m.grad.dtype == torch.float32 for m in masters),
            not any(m is p for m, p in zip(masters, params)),
            all(p.grad is None for p in params),
            all(torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in zip(params, masters)),
        ])

    hooks = [register_optimizer_step_pre_hook(before_step),
             register_optimizer_step_post_hook(lambda opt, *_: masters_after.__setitem__(
                 slice(None), [m.detach().clone() for m in opt.param_groups[0]["params"]]))]
    try:
        summary = apex_o2.train(make_cfg(tmp_path, ApexO2Config, max_steps=5, log_every=1))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(checks) == 5 and all(all(c) for c in checks), checks
    assert logits_dtypes == [torch.float32] * 5  # O2Forward: fp16 inside, fp32 out, so the loss is fp32
    assert summary["optimizer_steps"] == 5 and summary["skipped_steps"] == 0
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    names = [name for name, _ in built[0].named_parameters()]
    assert all(torch.equal(state[name], m) for name, m in zip(names, masters_after))  # the masters, not fp16


def test_o2_masters_round_trip_into_masters_and_the_fp16_copy():
    """What --resume and --restore-best load: fp32 values into the masters exactly, and rounded into the model."""
    torch.manual_seed(0)
    raw = ConvBN()
    model_params = [p for p in raw.parameters() if p.requires_grad]
    master_params = [nn.Parameter(p.detach().clone()) for p in model_params]
    O2Forward(cast_o2(raw))
    masters = O2Masters(raw, model_params, master_params)
    saved = masters.state_dict()
    assert saved["bn.num_batches_tracked"].dtype == torch.int64
    with torch.no_grad():
        for m in master_params:
            m.add_(1.0)
        for p in model_params:
            p.zero_()
    masters.load_state_dict(saved)
    assert all(torch.equal(m, saved[name]) for m, (name, _) in zip(master_params, raw.named_parameters()))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model_params, master_params))
    assert raw.conv.weight.dtype == torch.float16  # loading does not undo the cast


def train_or_fail(loop, cfg) -> dict:
    """loop.train(cfg); a run that diverges (the loop's NaN abort) fails the test: the pairings below train well."""
    try:
        return loop.train(cfg)
    except TrainingDiverged as e:
        pytest.fail(f"{loop.__name__} diverged: {e}")


def test_o2_equals_native_fp16_autocast_without_batchnorm(tmp_path):
    """With no BatchNorm, O2's fp16 model computes the ops autocast(float16) computes, on the same rounded
    weights, and both step fp32 weights: the two trajectories agree to rounding."""
    a = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "amp"), precision="16-mixed", model="mlp",
                              max_steps=40))
    b = train_or_fail(apex_o2, make_cfg(tmp_path, ApexO2Config, out_dir=str(tmp_path / "o2"), model="mlp", max_steps=40))
    wa = torch.load(tmp_path / "amp" / "last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "o2" / "last.pt", weights_only=True)["model"]
    diff = max_param_diff(wa, wb)
    assert diff < 1e-6, f"16-o2 vs 16-mixed: max abs diff {diff:.3g} (bound 1e-6)"
    assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-5)


def test_o2_equals_native_fp16_autocast_with_gradient_clipping(tmp_path):
    """The same pairing with --grad-clip 0.1 (below the mlp's gradient norm: every step clips): both clip the true,
    unscaled gradients, O2 its fp32 masters', 16-mixed its weights' after scaler.unscale_, so the trajectories still
    agree to rounding. Clipping the scaled gradients, or gradients that are no longer there, does not."""
    flags = dict(model="mlp", max_steps=40, grad_clip=0.1)
    a = train_or_fail(single, make_cfg(tmp_path, out_dir=str(tmp_path / "amp"), precision="16-mixed", **flags))
    b = train_or_fail(apex_o2, make_cfg(tmp_path, ApexO2Config, out_dir=str(tmp_path / "o2"), **flags))
    wa = torch.load(tmp_path / "amp" / "last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "o2" / "last.pt", weights_only=True)["model"]
    diff = max_param_diff(wa, wb)
    print(f"16-o2 vs 16-mixed, --grad-clip 0.1: max abs diff {diff:.3g}")
    assert diff < 1e-6, f"16-o2 vs 16-mixed, --grad-clip 0.1: max abs diff {diff:.3g} (bound 1e-6)"
    assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-5)


# ---------------------------------------------------------------------- the flags
def test_apex_o2_without_apex_is_a_one_line_error(tmp_path):
    proc = run_script("apex_o2", "--precision", "apex-o2", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --precision: ") and "apex.amp" in err[0] and "16-o2" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("precision", ["16-o2", "apex-o2"])
def test_other_scripts_refuse_o2_and_point_to_its_script(tmp_path, capsys, precision):
    code = run(single.train, script="single", argv=["--precision", precision, "--out-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --precision: ") and f"launch/apex_o2.py --precision {precision}" in err[0]
    assert not (tmp_path / "r").exists()


def test_apex_o2_script_takes_o2_only(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(apex_o2.train, ApexO2Config, script="apex_o2", argv=["--precision", "16-mixed"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == \
        "error: --precision: invalid choice: '16-mixed' (allowed: '16-o2', 'apex-o2')"
