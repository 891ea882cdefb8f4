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


# ---------------------------------------------------------------------- tune (manual_train/tune/search.py)
from manual_train.tune import search  # noqa: E402
from manual_train.tune.search import Setup, Trial  # noqa: E402


def test_tune_setup_flag_reads_its_own_flag_not_the_first():
    setup = Setup(1, 1, 8, flags=(("--a", "1"), ("--b", "2"), ("--c", None)))
    assert setup.flag("--b") == "2" and setup.flag("--a") == "1" and setup.flag("--c", "x") is None
    assert setup.flag("--d", "x") == "x"


def test_tune_set_replaces_or_appends_a_flag():
    assert search._set(["--x", "1"], "--y", 2) == ["--x", "1", "--y", "2"]
    assert search._set(["--y", "1", "--x", "1"], "--y", 2) == ["--y", "2", "--x", "1"]
    assert search._set(["--y=1"], "--y", 3) == ["--y=3"]
    assert search._set(["--a"], "--s", None) == ["--a", "--s"] and search._set(["--s"], "--s", None) == ["--s"]


def test_tune_estimate_before_and_after_a_trial_of_that_kind():
    state = search._Search(run=None, clock=lambda: 0.0, budget_s=100.0, trial_s=5.0, progress=lambda text: None)
    state.trials = [Trial(ok=True, wall_s=10.0)]  # the warm-up: 10 s, and a trial trains 5 s more
    assert state.estimate(Setup(1, 1, 8)) == 15.0
    assert state.estimate(Setup(2, 1, 4)) == 22.5  # each further process: half as long again (it starts torch)
    assert state.estimate(Setup(1, 1, 8, flags=(("--compile", "model"),))) == 75.0  # + 60 s guessed for a compile
    state.walls[(1, "none")] = [20.0]
    assert state.estimate(Setup(1, 1, 8)) == 20.0 and state.estimate(Setup(4, 1, 2)) == 50.0
    state.walls[(1, "model")] = [33.0]
    assert state.estimate(Setup(1, 1, 8, flags=(("--compile", "model"),))) == 33.0


def test_tune_command_writes_the_batch_whenever_it_differs_from_the_users():
    user = ["--model", "mlp"]
    assert search.command(Setup(1, 1, 64), user, 32)["argv"] == ["python", "launch/single.py", "--model", "mlp",
                                                                 "--batch-size", "64"]
    assert search.command(Setup(1, 1, 16), user, 32)["argv"][-2:] == ["--batch-size", "16"]
    assert search.command(Setup(1, 1, 32), user, 32)["argv"] == ["python", "launch/single.py", "--model", "mlp"]
    assert search.command(Setup(2, 1, 16), user, 32)["argv"][-2:] == ["--batch-size", "16"]
    mine = ["--batch-size", "32"]  # the user's own --batch-size is kept (rewritten to the same value)
    assert search.command(Setup(1, 1, 32), mine, 32)["argv"][-2:] == ["--batch-size", "32"]


def test_tune_layouts_split_the_cores_and_the_micro_batch():
    def layouts(ctx, cur):
        found, why = search.levers(ctx)[0].options(cur)
        return [(s.ranks, s.threads, s.batch) for s in found], why

    assert layouts(search.Context(cores=4), Setup(1, 4, 32))[0] == [(2, 2, 16), (4, 1, 8), (1, 2, 32)]
    assert layouts(search.Context(cores=2), Setup(1, 2, 32))[0] == [(2, 1, 16), (1, 1, 32)]
    assert layouts(search.Context(cores=1), Setup(1, 1, 32)) == ([], "one core: nothing to split")
    assert layouts(search.Context(cores=8, gpus=2), Setup(1, 8, 32))[0] == [(2, 4, 16)]
    assert layouts(search.Context(cores=8, gpus=1), Setup(1, 8, 32)) == ([], "one GPU: one process")
    assert layouts(search.Context(cores=1, gpus=2), Setup(1, 1, 32))[0] == [(2, 1, 16)]  # never 0 threads
    assert layouts(search.Context(cores=4), Setup(1, 4, 33)) == (
        [(1, 2, 33)], "the global micro-batch 33 does not split over 2 or 4 ranks")


def test_tune_describe_names_what_differs_from_the_reference():
    ref = Setup(1, 2, 32, flags=(("--num-workers", "1"),))
    assert search.describe(Setup(2, 1, 16, flags=(("--num-workers", "1"), ("--static-graph", None))), ref) == \
        "2 ranks x 1 thread --static-graph"
    assert search.describe(Setup(1, 2, 64, flags=ref.flags), ref) == "global batch x2"
    assert search.describe(Setup(1, 1, 32, flags=(("--num-workers", "2"),)), ref) == "1 rank x 1 thread --num-workers 2"
    assert search.describe(ref, ref) == "(as the reference)"


def test_tune_repeat_noise_is_half_the_range_of_the_logs():
    runs = [Trial(ok=True, sample_s=v) for v in (1.0, 4.0, 2.0)]
    assert search.repeat_noise(runs) == pytest.approx(math.log(4) / 2)
    assert search.repeat_noise(runs[:1]) == 0.0 and search.repeat_noise([Trial(ok=False)] * 3) == 0.0


def write_metrics(folder, rows, summary=None):
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["step,epoch,split,loss,acc,lr,samples_per_s,time_s"]
    lines += [f"{step},1,{split},1.0,0.5,0.1,100,{t}" for step, split, t in rows]
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (folder / "summary.json").write_text(__import__("json").dumps(summary))
    return folder


def test_tune_read_metrics_keeps_the_clean_intervals_and_the_later_evaluations(tmp_path):
    from manual_train.tune import trials

    rows = [(1, "train", 1.0), (2, "train", 2.0), (3, "train", 3.0), (3, "val", 3.5), (4, "train", 4.5),
            (5, "train", 5.5), (6, "train", 9.5), (6, "val", 10.0), (7, "train", 11.0), (8, "train", 12.0),
            (8, "val", 12.25)]
    out = trials.read_metrics(write_metrics(tmp_path / "a", rows, {"compile_s": 12.5, "peak_mem_bytes": 100}), 8)
    # intervals 1, 1, (an evaluation inside), 1, 4 (over twice the median: left out), (evaluation), 1
    assert out["sample_s"] == 4 / 4 / 8 and out["noise"] == pytest.approx(math.log(4) / 4)
    assert out["eval_s"] == 0.375 and out["eval_noise"] == 0.0  # the first evaluation (0.5 s) left out
    assert out["compile_s"] == 12.5 and out["peak_mem_bytes"] == 100
    fast = [(s, "train", 0.1 * s) for s in range(1, 6)]  # 0.4 s in all: still timed
    out = trials.read_metrics(write_metrics(tmp_path / "b", fast), 2)
    assert out["sample_s"] == pytest.approx(0.05) and "eval_s" not in out
    assert out["compile_s"] == 0.0 and out["peak_mem_bytes"] is None
    assert trials._spread([1.0, 2.0, 4.0]) == 0.0 and trials._spread([1.0, 1.0, 4.0, 4.0, 4.0]) > 0


def test_tune_last_line_prefers_an_error_line(tmp_path):
    from manual_train.tune import trials

    log = tmp_path / "log"
    log.write_text("start\nerror: --x: bad\nmore\n")
    assert trials._last_line(log) == "error: --x: bad"
    log.write_text("start\n\ndone: 3 steps\n\n")
    assert trials._last_line(log) == "done: 3 steps"
    log.write_text("\n")
    assert trials._last_line(log) == "(no output)"


def test_tune_machine_reads_cores_memory_and_flags():
    import os

    from manual_train.tune import trials

    meminfo = open("/proc/meminfo").read()
    total = next(int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemTotal:")) * 1024
    cpu_flags = set(next(ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")))
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})  # this process's cores, not the machine's
        info = trials.machine(False)
    finally:
        os.sched_setaffinity(0, before)
    assert info["cores"] == 1 and info["memory_bytes"] == total and info["gpus"] == []
    assert set(info["cpu_flags"]) == set(trials.FLAGS_OF_INTEREST) & cpu_flags
    assert info["fast_bf16"] == bool({"avx512_bf16", "amx_bf16"} & cpu_flags)
