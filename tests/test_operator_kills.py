"""Tests owed to operator mutants (tests/operator_mutants.py, docs/mutants-operators.md): each observes a value that
a generated mutant changed and no other fast test read. Cheap: no training run, seconds in all."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import make_cfg

from manual_train import optim


def lr_curve(tmp_path, total_steps: int, **overrides) -> list:
    cfg = make_cfg(tmp_path, model="mlp", lr=1.0, **overrides)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = optim.build_scheduler(cfg, opt, total_steps)
    out = []
    for _ in range(total_steps + 2):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_the_schedule_warms_up_linearly_then_decays_as_a_cosine_to_zero(tmp_path):
    lrs = lr_curve(tmp_path, 10, warmup_steps=4)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:11] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(7)])
    assert lrs[11] == pytest.approx(0.0, abs=1e-15)  # past the end: stays at zero
    const = lr_curve(tmp_path, 10, warmup_steps=2, schedule="constant")
    assert const[:2] == pytest.approx([0.5, 1.0]) and const[2:] == [1.0] * 10
    assert lr_curve(tmp_path, 5)[:6] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(6)])
