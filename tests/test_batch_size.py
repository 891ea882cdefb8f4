"""Batch size: LR scaling rules and the max-batch-size search (double, then binary search)."""
from __future__ import annotations

import math

import pytest
from conftest import make_cfg

from manual_train.batch_size import find_max_batch_size
from manual_train.find_batch_size import main as find_main
from manual_train.optim import scaled_lr


class Budget:
    """A monotone fake: sizes up to `capacity` fit; records what was tried."""

    def __init__(self, capacity):
        self.capacity, self.tried = capacity, []

    def __call__(self, b):
        self.tried.append(b)
        return b <= self.capacity


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 8, 100, 127, 128, 129, 1000])
def test_finds_the_exact_largest_size(capacity):
    fits = Budget(capacity)
    assert find_max_batch_size(fits, start=1, limit=4096) == capacity
    assert len(fits.tried) == len(set(fits.tried)), "no size is tried twice"
    assert len(fits.tried) <= 2 * math.ceil(math.log2(capacity + 1)) + 2  # doubling + bisection, not a scan


def test_doubles_first_then_bisects():
    fits = Budget(100)
    find_max_batch_size(fits, start=4, limit=10_000)
    assert fits.tried[:6] == [4, 8, 16, 32, 64, 128]  # grow until the first failure
    assert all(64 < b < 128 for b in fits.tried[6:])  # then only between last success and failure


def test_the_first_size_already_fails():
    fits = Budget(3)
    assert find_max_batch_size(fits, start=4, limit=100) == 0
    assert fits.tried == [4]


def test_never_fails_up_to_the_dataset_size():
    fits = Budget(10 ** 9)
    assert find_max_batch_size(fits, start=1, limit=1500) == 1500
    assert fits.tried[-1] == 1500 and max(fits.tried) == 1500  # capped, never beyond the data


def test_limit_between_powers_of_two():
    assert find_max_batch_size(Budget(700), start=16, limit=1000) == 700
    assert find_max_batch_size(Budget(5000), start=16, limit=1000) == 1000


@pytest.mark.parametrize("rule,expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_scaling_rules(tmp_path, rule, expected):
    cfg = make_cfg(tmp_path, lr=0.1, lr_scaling=rule, base_batch_size=32)
    assert scaled_lr(cfg, 128) == pytest.approx(expected)


def test_cpu_search_needs_a_budget(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --memory-budget-bytes")
