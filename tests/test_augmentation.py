"""Random augmentation in loader workers, resumed mid-epoch (manual_train/data.py PerSampleRNG, docs/checkpointing.md).

cifar10's random crops and flips draw from torch's global RNG inside the worker that loads the sample. A worker's
stream depends on which batches it served before, and a resumed epoch hands the batches to its workers from the
resume point: without per-sample seeding, every augmentation after a mid-epoch resume differs. PerSampleRNG seeds
each item from (seed, epoch, index). The data here is the digits with cifar10's kind of transforms (a padded random
crop and a horizontal flip), since cifar10 itself cannot be written by a test (torchvision checks its files' MD5).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2 as T

from conftest import assert_same_path_bitwise, make_cfg
from manual_train import data
from manual_train.loops import single
from manual_train.models import DataInfo

FLAGS = dict(model="mlp", dataset="digits", epochs=2, batch_size=64, num_workers=2, log_every=5,
             checkpoint_every_steps=9)
# micro-steps: after the step-27 checkpoint, 3 steps into epoch 2 (24 steps an epoch). An odd count: the resumed
# epoch's first batch goes to the other worker than in the uninterrupted run (the workers take batches in turn)
CRASH_AT = 30


class Augmented(Dataset):
    """The digits (1x8x8) under a cifar10-style training transform: padded random crop, random horizontal flip."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.transform = T.Compose([T.RandomCrop(8, padding=1), T.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        x, y = self.dataset[i]
        return self.transform(x), y


class Crash(Exception):
    pass


def train(tmp_path, name, per_sample: bool, monkeypatch, crash_at: int = 0, **flags):
    """single.train on the augmented digits (wrapped in PerSampleRNG when per_sample); crash_at > 0 raises in the
    loss at that micro-step, as a killed run would stop."""
    def datasets(cfg):
        train_set, val = data.load_digits_split()
        augmented = Augmented(train_set)
        return (data.PerSampleRNG(augmented, cfg.seed) if per_sample else augmented), val, DataInfo("digits",
                                                                                                   (1, 8, 8), 10)

    real_loss, calls = single.loss_fn, [0]

    def loss(logits, y, **kw):
        if kw:  # evaluation's
            return real_loss(logits, y, **kw)
        calls[0] += 1
        if calls[0] == crash_at:
            raise Crash
        return real_loss(logits, y)

    with monkeypatch.context() as m:
        m.setattr(data, "_datasets", datasets)
        m.setattr(single, "loss_fn", loss)
        cfg = make_cfg(tmp_path, out_dir=str(tmp_path / name), **FLAGS, **flags)
        if crash_at:
            with pytest.raises(Crash):
                single.train(cfg)
        else:
            single.train(cfg)
    return torch.load(tmp_path / name / "last.pt", weights_only=True)


def resumed_vs_uninterrupted(tmp_path, monkeypatch, capsys, per_sample: bool) -> tuple[dict, dict]:
    full = train(tmp_path, "full", per_sample, monkeypatch)
    crashed = train(tmp_path, "resumed", per_sample, monkeypatch, crash_at=CRASH_AT)
    assert (crashed["epoch"], crashed["progress"]["micro_steps_done"]) == (1, 3)  # step 27: mid-epoch 2
    capsys.readouterr()
    resumed = train(tmp_path, "resumed", per_sample, monkeypatch, resume="auto")
    assert "at step 27, in epoch 2" in capsys.readouterr().out  # a resume, not a rerun from scratch
    return full["model"], resumed["model"]


def test_a_mid_epoch_resume_with_augmentation_in_two_workers_is_bitwise(tmp_path, monkeypatch, capsys):
    full, resumed = resumed_vs_uninterrupted(tmp_path, monkeypatch, capsys, per_sample=True)
    assert_same_path_bitwise(full, resumed, "resumed mid-epoch with 2 workers")


def test_without_per_sample_seeds_the_same_resume_differs(tmp_path, monkeypatch, capsys):
    """The check's power: the workers' own streams (what cifar10 had before) make the resumed run differ."""
    full, resumed = resumed_vs_uninterrupted(tmp_path, monkeypatch, capsys, per_sample=False)
    assert max((full[k] - resumed[k]).abs().max().item() for k in full) > 1e-4


def test_an_items_augmentation_depends_on_seed_epoch_and_index_only():
    train_set, _ = data.load_digits_split()
    ds = data.PerSampleRNG(Augmented(train_set), seed=3)
    ds.set_epoch(1)
    first = [ds[i][0] for i in (5, 9, 5)]
    torch.rand(7)  # the global stream moves: the items do not
    again = [ds[i][0] for i in (9, 5)]
    assert torch.equal(first[0], first[2]) and torch.equal(first[1], again[0]) and torch.equal(first[0], again[1])
    ds.set_epoch(2)
    assert sum(not torch.equal(ds[i][0], data.PerSampleRNG(Augmented(train_set), seed=3)[i][0])
               for i in range(20)) > 5  # another epoch (the second set is at epoch 0) draws anew
    state = torch.get_rng_state()
    ds[0]
    assert torch.equal(state, torch.get_rng_state())  # the caller's stream is left where it was


def test_the_per_sample_seed_is_splitmix64s_finalizer_and_stays_fixed():
    """mix64 is part of what a checkpoint resumes: a run saved by one version and resumed by another draws the same
    augmentation only if (seed, epoch, index) -> seed is the same function. Pinned to values of splitmix64's
    finalizer (constants 0xBF58476D1CE4E5B9, 0x94D049BB133111EB; start 0x9E3779B97F4A7C15), and nearby keys part."""
    assert data.mix64(0) == 5153396120588991192
    assert data.mix64(1, 2, 3) == 12137764019763327488
    assert len({data.mix64(0, 0, i) for i in range(1000)} | {data.mix64(0, 1, i) for i in range(1000)}) == 2000
