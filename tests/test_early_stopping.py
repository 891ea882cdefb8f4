"""Early stopping: scripted metric sequences, and a real run that stops and says so."""
from __future__ import annotations

import json
import math

import pytest
from conftest import make_cfg

from manual_train.early_stopping import EarlyStopping
from manual_train.loops import single


def feed(stopper, values):
    """Returns (improved flags, the evaluation index at which it asked to stop or None)."""
    improved = []
    for i, v in enumerate(values):
        improved.append(stopper.update(v, epoch=i))
        if stopper.should_stop:
            return improved, i
    return improved, None


def test_improve_then_plateau_stops_after_patience():
    es = EarlyStopping("val_loss", patience=3)
    improved, stopped = feed(es, [1.0, 0.8, 0.7, 0.7, 0.75, 0.71, 0.5])
    assert improved == [True, True, True, False, False, False]
    assert stopped == 5 and es.best == 0.7 and es.best_epoch == 2


def test_improvement_by_less_than_min_delta_does_not_count():
    es = EarlyStopping("val_loss", patience=2, min_delta=0.05)
    improved, stopped = feed(es, [1.0, 0.97, 0.96, 0.9])
    assert improved == [True, False, False] and stopped == 2 and es.best == 1.0


def test_accuracy_is_maximised():
    es = EarlyStopping("val_acc", patience=2)
    improved, stopped = feed(es, [0.5, 0.6, 0.55, 0.61, 0.6, 0.6])
    assert improved == [True, True, False, True, False, False] and stopped == 5 and es.best_epoch == 3


def test_a_non_finite_metric_stops_at_once():
    for bad in (math.nan, math.inf):
        es = EarlyStopping("val_loss", patience=10)
        improved, stopped = feed(es, [1.0, bad, 0.1])
        assert stopped == 1 and improved == [True, False] and "val_loss is" in es.reason


@pytest.mark.parametrize("monitor, values, stop_at, stopped", [
    ("val_acc", [0.5, 0.8, 0.97, 0.99], 0.95, 2), ("val_acc", [0.5, 0.8, 0.94], 0.95, None),
    ("val_loss", [1.0, 0.3, 0.2], 0.3, 1), ("val_loss", [1.0, 0.31], 0.3, None)])
def test_stop_at_ends_at_the_first_evaluation_that_reaches_the_target(monitor, values, stop_at, stopped):
    es = EarlyStopping(monitor, patience=0, stop_at=stop_at)
    assert feed(es, values)[1] == stopped
    assert ("target reached" in es.reason) == (stopped is not None)


def test_patience_zero_never_stops():
    es = EarlyStopping("val_loss", patience=0)
    _, stopped = feed(es, [1.0] + [2.0] * 50)
    assert stopped is None and es.best_epoch == 0


def test_state_round_trip_continues_the_count():
    a = EarlyStopping("val_loss", patience=3)
    feed(a, [1.0, 1.1, 1.2])
    b = EarlyStopping("val_loss", patience=3)
    b.load_state_dict(a.state_dict())
    assert b.wait == 2 and b.best == 1.0
    b.update(1.3, epoch=3)
    assert b.should_stop


def test_a_run_with_tiny_patience_stops_early_and_says_so(tmp_path):
    # nothing improves val_acc by 0.9 after the first evaluation: stops at the second, best is the first
    cfg = make_cfg(tmp_path, monitor="val_acc", early_stop_patience=1, early_stop_min_delta=0.9, epochs=5)
    summary = single.train(cfg)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["stopped_early"] is True and on_disk["best_epoch"] == 1 and on_disk["epochs_run"] == 2  # 1-based
    assert summary["optimizer_steps"] == 2 * 47
    assert (tmp_path / "run" / "best.pt").exists() and (tmp_path / "run" / "last.pt").exists()


def test_a_run_with_stop_at_stops_at_its_target_and_says_so(tmp_path):
    summary = single.train(make_cfg(tmp_path, epochs=6, monitor="val_acc", stop_at=0.5))
    assert summary["stopped_early"] and summary["epochs_run"] < 6
    assert summary["stop_reason"].startswith("target reached: val_acc") and summary["final_val_acc"] >= 0.5


def test_a_resumed_run_continues_the_patience_count(tmp_path):
    """The checkpoint holds early stopping's best and wait: a run stopped after epoch 1 and resumed stops where the
    uninterrupted run did (epoch 2), not a patience later (a fresh EarlyStopping takes epoch 2 for a new best)."""
    flags = dict(model="mlp", dataset="synthetic", synthetic_size=64, synthetic_shape="1,8,8", synthetic_classes=4,
                 schedule="constant", monitor="val_acc", early_stop_patience=1, early_stop_min_delta=0.9)
    whole = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), epochs=5, **flags))
    assert whole["stopped_early"] and whole["epochs_run"] == 2 and whole["best_epoch"] == 1
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), epochs=1, **flags))
    resumed = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), epochs=5, resume="auto", **flags))
    assert (resumed["stopped_early"], resumed["epochs_run"], resumed["best_epoch"]) == (True, 2, 1)
    assert resumed["optimizer_steps"] == whole["optimizer_steps"]


@pytest.mark.parametrize("restore", [True, False])
def test_restore_best_reloads_the_best_weights(tmp_path, restore):
    import torch

    cfg = make_cfg(tmp_path, monitor="val_acc", early_stop_patience=1, early_stop_min_delta=0.9, epochs=5,
                   restore_best=restore)
    summary = single.train(cfg)
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    assert best["step"] == 47
    with open(tmp_path / "run" / "metrics.csv") as f:
        val_rows = [line.split(",") for line in f if ",val," in line]
    first_val_loss = float(val_rows[0][3])
    if restore:
        assert summary["final_val_loss"] == pytest.approx(first_val_loss, rel=1e-6)
    else:
        assert summary["final_val_loss"] == pytest.approx(float(val_rows[1][3]), rel=1e-6)
