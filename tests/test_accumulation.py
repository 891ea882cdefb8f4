"""Gradient accumulation equals one big batch, also in the epoch's last, partial window."""
from __future__ import annotations

import pytest
import torch
from conftest import load_model_state, make_cfg, max_param_diff, run_script

from manual_train.loops import single


def train_weights(tmp_path, name, **flags):
    cfg = make_cfg(tmp_path, out_dir=str(tmp_path / name), **flags)
    summary = single.train(cfg)
    return load_model_state(tmp_path / name), summary


@pytest.mark.parametrize("epochs", [1, 3])
def test_16_x_4_equals_64(tmp_path, epochs):
    # 1500 samples: 23 windows of 64, then a last window of 28 = 16 + 12 (micro-batches 93 and 94)
    big, s_big = train_weights(tmp_path, "big", batch_size=64, epochs=epochs)
    acc, s_acc = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, epochs=epochs)
    assert s_acc["optimizer_steps"] == s_big["optimizer_steps"] == 24 * epochs
    assert s_acc["global_batch_size"] == 64 and s_acc["samples_seen"] == 1500 * epochs
    diff = max_param_diff(big, acc)
    assert diff < 1e-6, diff


def test_dividing_by_k_in_the_partial_window_fails_the_same_check(tmp_path, monkeypatch):
    """The naive weighting (each micro-batch loss / K, as Lightning and the article do) gives the last,
    28-sample window a gradient 28/64 the size of the big batch's: the parity check catches it."""
    # two epochs: epoch 1's partial window then falls mid-schedule (the cosine LR is ~0 at the very end)
    big, _ = train_weights(tmp_path, "big", batch_size=64, epochs=2)
    naive_window = lambda n, b, k, i: k * min(b, n - i * b)  # noqa: E731 (weight = 1/K for every micro-batch)
    monkeypatch.setattr(single.data, "window_samples", naive_window)
    naive, _ = train_weights(tmp_path, "naive", batch_size=16, accumulate=4, epochs=2)
    assert max_param_diff(big, naive) > 1e-4  # 100x the parity tolerance


def test_scheduler_and_step_counter_advance_once_per_window(tmp_path):
    _, summary = train_weights(tmp_path, "acc", batch_size=16, accumulate=4, max_steps=10, log_every=1,
                               optimizer="adamw", lr=1e-3)
    ckpt = torch.load(tmp_path / "acc" / "last.pt", weights_only=True)
    assert summary["optimizer_steps"] == 10 and ckpt["step"] == 10
    assert ckpt["scheduler"]["last_epoch"] == 10  # one scheduler step per window, not per micro-batch
    assert summary["samples_seen"] == 10 * 64
    assert all(int(s["step"]) == 10 for s in ckpt["optimizer"]["state"].values())  # AdamW counts its steps


def test_cli_level_parity(tmp_path):
    """The issue's done-when, through the real script: A/last.pt == B/last.pt within 1e-6."""
    a = run_script("single", "--batch-size", "16", "--accumulate", "4", "--epochs", "2", "--no-progress",
                   "--out-dir", str(tmp_path / "A"))
    b = run_script("single", "--batch-size", "64", "--epochs", "2", "--no-progress",
                   "--out-dir", str(tmp_path / "B"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "global batch 64 = batch 16 x accumulate 4" in a.stdout
    assert max_param_diff(load_model_state(tmp_path / "A"), load_model_state(tmp_path / "B")) < 1e-6
