"""Gradient accumulation equals one big batch, also in the epoch's last, partial window.

The proof runs in 64-true (float64): 16 x accumulate 4 equals batch 64 within 1e-9 on any CPU, on the mlp over
digits (the window arithmetic is the model's business nowhere; the cnn's float64 convolutions cost ~25 times the
mlp's CPU per sample and showed nothing more). The fp32 pairing
is held to a noise floor measured in the same test (conftest.fp32_noise_floor).
"""
from __future__ import annotations

import pytest
import torch
from conftest import (FP32_MODEL, PARITY_TOL_64, assert_cross_path_64, assert_within_fp32_floor, fp32_noise_floor, load_model_state,
                      make_cfg, max_param_diff, run_script)

from manual_train.loops import single

DIGITS = dict(model="mlp", precision="64-true")  # the 2- and 3-epoch proofs on the 1500 digits


def train_weights(tmp_path, name, **flags):
    cfg = make_cfg(tmp_path, out_dir=str(tmp_path / name), **flags)
    summary = single.train(cfg)
    return load_model_state(tmp_path / name), summary


@pytest.fixture
def big_2_epochs(reference):
    """Batch 64, 2 epochs of digits, 64-true, in this process (conftest's reference: computed once per pytest run):
    the reference of the 2-epoch pair, the ÷K variant and the CLI pair (one run, not three)."""
    return reference(batch_size=64, epochs=2, **DIGITS)


@pytest.mark.parametrize("epochs", [2, 3])
def test_16_x_4_equals_64(tmp_path, epochs, reference):
    # 1500 samples: 23 windows of 64, then a last window of 28 = 16 + 12 (micro-batches 93 and 94)
    big, s_big = reference(batch_size=64, epochs=epochs, **DIGITS)
    acc, s_acc = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, epochs=epochs, **DIGITS)
    assert s_acc["optimizer_steps"] == s_big["optimizer_steps"] == 24 * epochs
    assert s_acc["global_batch_size"] == 64 and s_acc["samples_seen"] == 1500 * epochs
    assert all(v.dtype == torch.float64 for v in acc.values())  # the checkpoint holds the float64 weights
    diff = max_param_diff(big, acc)
    assert diff <= PARITY_TOL_64, diff


# A short set for the same proof in a second (make mutants runs it against each accumulation mutant): 88 = 64 + 24
# samples, so each epoch's last window is partial and holds a short micro-batch (16 + 8).
SHORT = dict(model="mlp", dataset="synthetic", synthetic_size=88, synthetic_shape="1,8,8", synthetic_classes=4,
             epochs=2, precision="64-true", log_every=1)


def test_16_x_4_equals_64_on_a_short_set(tmp_path):
    big, s_big = train_weights(tmp_path, "big", batch_size=64, **SHORT)
    acc, s_acc = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, **SHORT)
    assert s_acc["optimizer_steps"] == s_big["optimizer_steps"] == 4 and s_acc["samples_seen"] == 2 * 88
    assert_cross_path_64(acc, big, "16 x 4 vs 64 (88 samples)")


def divide_by_k(monkeypatch):
    """The naive weighting: every micro-batch's window counted as K of it, so its weight is 1/K."""
    count = single.data.Windows.count

    def naive(self, micro_step):
        mine, _ = count(self, micro_step)
        return mine, mine * self.accumulate

    monkeypatch.setattr(single.data.Windows, "count", naive)


def test_dividing_by_k_in_the_partial_window_fails_the_same_check(tmp_path, monkeypatch, big_2_epochs):
    """The naive weighting (each micro-batch loss / K, as Lightning and the article do) gives the last,
    28-sample window a gradient 28/64 the size of the big batch's: the parity check catches it."""
    # two epochs: epoch 1's partial window then falls mid-schedule (the cosine LR is ~0 at the very end)
    big, _ = big_2_epochs
    divide_by_k(monkeypatch)
    naive, _ = train_weights(tmp_path, "naive", batch_size=16, accumulate=4, epochs=2, **DIGITS)
    assert max_param_diff(big, naive) > 1e6 * PARITY_TOL_64  # measured 6.3e-3 (the mlp, 2026-12-06)


def test_fp32_16_x_4_within_the_noise_floor_and_the_wrong_weighting_is_not(tmp_path, monkeypatch):
    """fp32, two epochs: the difference is rounding-sized (within 10 noise floors); the ÷K weighting is not."""
    flags = dict(model=FP32_MODEL, epochs=2)
    big, _ = train_weights(tmp_path, "big", batch_size=64, **flags)
    acc, _ = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, **flags)
    floor = fp32_noise_floor(lambda name: train_weights(tmp_path, name, batch_size=64, **flags)[0], big)
    assert_within_fp32_floor(max_param_diff(big, acc), floor, "16 x 4 vs 64")
    divide_by_k(monkeypatch)
    naive, _ = train_weights(tmp_path, "naive", batch_size=16, accumulate=4, **flags)
    with pytest.raises(AssertionError):
        assert_within_fp32_floor(max_param_diff(big, naive), floor, "÷K weighting vs 64")


def test_scheduler_and_step_counter_advance_once_per_window(tmp_path):
    _, summary = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, max_steps=10, log_every=1,
                               optimizer="adamw", lr=1e-3)
    ckpt = torch.load(tmp_path / "acc" / "last.pt", weights_only=True)
    assert summary["optimizer_steps"] == 10 and ckpt["step"] == 10
    assert ckpt["scheduler"]["last_epoch"] == 10  # one scheduler step per window, not per micro-batch
    assert summary["samples_seen"] == 10 * 64
    assert all(int(s["step"]) == 10 for s in ckpt["optimizer"]["state"].values())  # AdamW counts its steps


def test_cli_level_parity(tmp_path, big_2_epochs):
    """The accumulation promise, through the real script, in 64-true: `launch/single.py --batch-size 16 --accumulate
    4` ends within 1e-9 of batch 64 (the same loop with the same flags, run in this process: a 64-true bound, not a
    bitwise one, so the two may be two kinds of process)."""
    common = ("--model", "mlp", "--epochs", "2", "--precision", "64-true", "--no-progress")
    a = run_script("single", "--batch-size", "16", "--accumulate", "4", *common, "--out-dir", str(tmp_path / "A"))
    assert a.returncode == 0, a.stderr
    assert "global batch 64 = batch 16 x accumulate 4" in a.stdout
    assert_cross_path_64(load_model_state(tmp_path / "A"), big_2_epochs[0], "launch/single.py 16 x 4 vs 64")
