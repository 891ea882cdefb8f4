"""Loss logging without retained graphs, and evaluation under no_grad / inference_mode with exact sums."""
from __future__ import annotations

import csv
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import make_cfg

from manual_train import data, models
from manual_train.evaluation import evaluate
from manual_train.loops import single
from manual_train.precision import autocast_for


class _Sentinel:
    pass


class _Tag(torch.autograd.Function):
    """Identity on the loss that plants a weak-referenceable object in this step's autograd graph.

    The object lives exactly as long as the graph node does, so a live sentinel from an earlier
    step means something still holds that step's graph.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.sentinel = _Sentinel()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def run_and_watch_graphs(tmp_path, monkeypatch, steps=25):
    sentinels, alive_at_each_step, step_losses = [], [], []

    def tagged_loss(logits, y, **kw):
        if kw:  # evaluation's (reduction="sum")
            return models.loss_fn(logits, y, **kw)
        loss = _Tag.apply(models.loss_fn(logits, y))
        # graphs of steps before the previous one must be gone by now
        alive_at_each_step.append(sum(r() is not None for r in sentinels[:-1]))
        sentinels.append(weakref.ref(loss.grad_fn.sentinel))  # the _Tag node is the loss's grad_fn
        step_losses.append(loss.item())  # the test may sync; the loop must not
        return loss

    monkeypatch.setattr(single, "loss_fn", tagged_loss)
    cfg = make_cfg(tmp_path, max_steps=steps, log_every=5)
    single.train(cfg)
    return alive_at_each_step, step_losses


def test_no_graph_outlives_its_step_and_the_logged_loss_is_the_mean(tmp_path, monkeypatch):
    alive, step_losses = run_and_watch_graphs(tmp_path, monkeypatch, steps=25)
    assert len(alive) == 25 and max(alive) == 0
    # each train row of metrics.csv is the mean of the per-step losses in its log window
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 25]
    for i, row in enumerate(rows):
        window = step_losses[5 * i:5 * i + 5]
        assert float(row["loss"]) == pytest.approx(sum(window) / 5, rel=1e-6)
    assert float(rows[0]["loss"]) != pytest.approx(step_losses[4], rel=1e-3)  # a mean, not the last value


def test_the_graph_check_catches_an_undetached_running_sum(tmp_path, monkeypatch):
    """The deliberately wrong version: make detach() a no-op, so `losses.append(loss.detach())` is the
    classic `losses.append(loss)` bug. The same check must now see old graphs alive."""
    monkeypatch.setattr(torch.Tensor, "detach", lambda self: self)
    alive, _ = run_and_watch_graphs(tmp_path, monkeypatch)
    assert min(alive[4:]) >= 3  # every earlier step of the log window keeps its graph in the list, until its row


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    cfg = make_cfg(tmp, max_steps=30)
    single.train(cfg)
    train_ds, val_ds, info = data.build_datasets(cfg)
    model = models.build_model("cnn", info)
    model.load_state_dict(torch.load(tmp / "run" / "last.pt", weights_only=True)["model"])
    return cfg, model, val_ds


@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_evaluation_builds_no_graph_and_restores_the_mode(trained, mode):
    cfg, model, val_ds = trained
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append(
        (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), out.requires_grad, m.training)))
    loader = data.build_loader(val_ds, cfg, torch.device("cpu"), batch_size=64)
    autocast = autocast_for(cfg.precision, torch.device("cpu"))
    for was_training in (True, False):
        model.train(was_training)
        seen.clear()
        loss_sum, correct, count = evaluate(model, loader, torch.device("cpu"), autocast, mode)
        assert model.training is was_training
        assert len(seen) == 5 and all(grad is False and out_grad is False and training is False
                                      for grad, _, out_grad, training in seen)
        assert all(inf is (mode == "inference") for _, inf, _, _ in seen)
        assert not loss_sum.requires_grad and int(count) == 297


def test_validation_metrics_are_exact_sums_not_a_mean_of_batch_means(trained):
    cfg, model, val_ds = trained
    model.eval()
    x, y = val_ds.tensors
    with torch.no_grad():
        logits = model(x)  # all 297 samples at once: the reference
    ref_loss = F.cross_entropy(logits, y, reduction="sum").item() / 297
    ref_acc = (logits.argmax(1) == y).sum().item() / 297
    autocast = autocast_for(cfg.precision, torch.device("cpu"))
    loader = data.build_loader(val_ds, cfg, torch.device("cpu"), batch_size=64)  # 4 x 64 + 41
    loss_sum, correct, count = evaluate(model, loader, torch.device("cpu"), autocast)
    assert (loss_sum / count).item() == pytest.approx(ref_loss, rel=1e-6)
    assert (correct / count).item() == ref_acc
    # the check can fail: the mean of per-batch means weights the 41-sample batch like the others
    batch_means = [F.cross_entropy(model(xb), yb).item() for xb, yb in loader]
    assert sum(batch_means) / len(batch_means) != pytest.approx(ref_loss, rel=1e-6)
