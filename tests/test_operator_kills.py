"""Tests owed to operator mutants (tests/operator_mutants.py, docs/mutants-operators.md): each observes a value that
a generated mutant changed and no other fast test read. Cheap: no training run, seconds in all."""
from __future__ import annotations

import math
import os
import re

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
    state.walls[(1, "none")] = [12.0, 20.0]  # the last one counts
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
    two = [(1, "train", 1.0), (1, "val", 1.5), (2, "train", 2.0), (2, "val", 2.25)]
    assert trials.read_metrics(write_metrics(tmp_path / "c", two), 1)["eval_s"] == 0.25  # the first left out
    one = [(1, "train", 1.0), (1, "val", 1.5), (2, "train", 2.0)]
    assert trials.read_metrics(write_metrics(tmp_path / "d", one), 1)["eval_s"] == 0.5  # the only one kept
    flat = [(s, "train", 1.0) for s in range(1, 5)]  # no time between the rows (metrics.csv's ms rounding)
    assert "sample_s" not in trials.read_metrics(write_metrics(tmp_path / "e", flat), 1)
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


# ---------------------------------------------------------------------- parity (manual_train/parity.py)
from manual_train import parity  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2).double()
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))  # not floating: not traced


def test_parity_record_writes_every_floating_tensor_by_plain_name_and_loads_back(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    for step in range(4):
        parity.record(model, step, tmp_path / "t", loss=torch.tensor(0.5 * step) if step else None)
        with torch.no_grad():
            model.lin.weight.add_(0.25)
    trace = parity.load_trace(tmp_path / "t", "--trace-a")
    assert sorted(trace["steps"]) == [0, 1, 2, 3] == sorted(trace["full"])  # a small model: full state every step
    assert trace["meta"]["dtypes"] == ["float64"] and trace["meta"]["full_every"] == 1
    assert [trace["steps"][s]["loss"] for s in range(4)] == [None, 0.5, 1.0, 1.5]
    assert set(trace["steps"][2]["checksums"]) == {"lin.weight", "lin.bias"}
    w = torch.load(trace["full"][2], weights_only=True)["lin.weight"]
    assert torch.equal(w, model.lin.weight.detach() - 0.5)
    assert trace["steps"][2]["checksums"]["lin.weight"] == parity.checksums(w)


@pytest.mark.parametrize("numbers,every", [(parity.FULL_EVERY_ELEMENTS, 1), (parity.FULL_EVERY_ELEMENTS + 1, 50)])
def test_parity_full_state_every_step_up_to_a_million_numbers(tmp_path, numbers, every):
    writer = parity.TraceWriter(tmp_path, {})
    state = {"w": torch.zeros(numbers, dtype=torch.float32)}
    for step in (0, 1):
        writer.write(step, state)
    assert writer.full_every == every
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == \
        ["step-00000000.pt", "step-00000001.pt"][:1 if every > 1 else 2]


def test_parity_nudge_moves_every_parameter_one_ulp_up():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    parity.nudge_one_ulp(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.nextafter(before[k], torch.full_like(v, math.inf)))


def test_parity_run_trace_records_each_steps_own_losses(tmp_path):
    from types import SimpleNamespace

    model = Tiny()
    cfg = make_cfg(tmp_path, model="mlp")
    cfg.trace_dir = str(tmp_path / "t")
    run = SimpleNamespace(script="single", env=SimpleNamespace(world_size=1, master_process=True), replicas=1,
                          global_batch_size=8, total_steps=4, cfg=cfg, tracked={"model": model}, distributed=False)
    trace = parity.RunTrace(run)
    trace.start(0)
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    trace.stepped(losses)  # step 1: both
    losses.append(torch.tensor(4.0))
    trace.stepped(losses)  # step 2: only the one added since
    trace.window_logged()  # the loop starts a new list
    trace.stepped([torch.tensor(5.0), torch.tensor(6.0)])  # step 3: both micro-steps of the new list
    loaded = parity.load_trace(tmp_path / "t", "--a")
    assert {s: e["loss"] for s, e in loaded["steps"].items()} == {0: None, 1: 3.0, 2: 4.0, 3: 11.0}
    assert loaded["meta"]["total_steps"] == 4 and loaded["meta"]["start_step"] == 0


def test_parity_refusal_names_the_step_flags_that_differ():
    config = {name: 1 for name in parity.SAME_FLAGS}
    a = {"config": {**config, "epochs": 2, "max_steps": None, "limit_train_batches": None}, "global_batch_size": 8,
         "total_steps": 10}
    b = {"config": {**config, "epochs": 3, "max_steps": None, "limit_train_batches": None}, "global_batch_size": 8,
         "total_steps": 15}
    assert parity.refusal(a, b) == "the number of optimizer steps differs: 10 (A) vs 15 (B) (--epochs 2 (A) vs 3 (B))"
    assert parity.refusal(a, dict(a)) is None


def trace_of(names, values, precision="64-true"):
    steps = {s: {"step": s, "loss": 1.0, "checksums": {n: list(v) for n in names}} for s, v in values.items()}
    return {"dir": None, "meta": {"precision": precision}, "steps": steps, "full": {}}


def test_parity_different_tensors_are_refused_naming_three_of_each():
    v = {0: [0.0] * 7}
    with pytest.raises(parity.BadInput) as e:
        parity.compare(trace_of(["a", "b", "c", "d", "x"], v), trace_of(["x", "y"], v))
    assert str(e.value) == "the traces hold different tensors: only in A ['a', 'b', 'c'], only in B ['y']"


def test_parity_floor_mode_bounds_b_by_ten_floors_and_needs_every_step():
    base = {s: [0.5] * 7 for s in range(3)}
    floor = trace_of(["w"], {s: [0.5 + 1e-6 * (s + 1)] + [0.5] * 6 for s in range(3)}, "32-true")
    a = trace_of(["w"], base, "32-true")
    near = trace_of(["w"], {s: [0.5 + 5e-6 * (s + 1)] + [0.5] * 6 for s in range(3)}, "32-true")
    status, report = parity.compare(a, near, floor=floor)
    assert status == 0 and report.startswith("equal within 10 x the fp32 noise floor over 3 steps")
    far = trace_of(["w"], {s: [0.5 + 2e-5 * (s + 1)] + [0.5] * 6 for s in range(3)}, "32-true")
    status, report = parity.compare(a, far, floor=floor)
    assert status == 1 and report.startswith("parted at optimizer step 0")
    short = trace_of(["w"], {0: [0.5] * 7}, "32-true")
    with pytest.raises(parity.BadInput, match="--trace-floor"):
        parity.compare(a, near, floor=short)
    assert parity.compare(a, far)[1].startswith("no verdict")  # 32-true without a floor


def test_parity_report_names_the_largest_difference_and_ends_its_table_at_the_last_step():
    base = {s: [0.5] * 7 for s in range(4)}
    b = {s: list(v) for s, v in base.items()}
    b[2][3] = 0.5 + 2.0 ** -34
    status, report = parity.compare(trace_of(["w"], base), trace_of(["w"], b))
    assert status == 0 and "largest weight difference 5.82e-11 (w, step 2)" in report
    n = 258  # a table that reaches its last row through the doubling steps (1 + 256 = 257, the last step)
    base = {s: [0.5] * 7 for s in range(n)}
    b = {s: [0.5 + (1e-3 if s >= 1 else 0.0)] + [0.5] * 6 for s in range(n)}
    status, report = parity.compare(trace_of(["w"], base), trace_of(["w"], b))
    table = [ln.split()[0] for ln in report.splitlines()[3:] if ln.split()[0].isdigit()]
    assert status == 1 and table == ["1", "2", "3", "5", "9", "17", "33", "65", "129", "257"]


def test_parity_free_port_and_last_line(tmp_path):
    port = parity._free_port()
    assert isinstance(port, int) and 1024 <= port <= 65535
    log = tmp_path / "a.log"
    log.write_text("x\nerror: --a: bad\nTraceback\n")
    assert parity._last_line(log) == "error: --a: bad"
    log.write_text("one\ntwo\n")
    assert parity._last_line(log) == "two"


def test_tune_half_the_range_between_rounds_is_the_noise():
    ref = [Trial(ok=True, sample_s=1.0)] * 2
    winner, verdicts = search.decide(ref, {"a": [Trial(ok=True, sample_s=v) for v in (0.7, 0.9)]})
    assert winner == "a" and verdicts["a"]["noise"] == pytest.approx(math.sqrt(0.9 / 0.7) - 1)


def test_tune_batch_lever_scales_the_lr_by_the_optimizers_rule():
    sgd = "".join(["s", "gd"])  # as argparse hands it over: not the interned literal
    for optimizer, rule in ((sgd, "linear"), ("adamw", "sqrt")):
        ctx = search.Context(cores=2, optimizer=optimizer, train_samples=1500)
        found, _ = next(lv for lv in search.levers(ctx) if lv.name == "batch-size").options(Setup(1, 2, 32))
        assert [(s.batch, s.flag("--lr-scaling"), s.flag("--base-batch-size")) for s in found] == \
            [(64, rule, "32"), (128, rule, "32")]


def test_tune_a_one_time_cost_counts_only_for_a_lever_that_pays_once():
    ref = [Trial(ok=True, sample_s=1.0)]
    slow_compile = [Trial(ok=True, sample_s=0.5, compile_s=80.0)]
    assert search.decide(ref, {"a": slow_compile}, run_samples=100)[0] == "a"  # not pays_once: its speed alone
    _, verdicts = search.decide(ref, {"a": slow_compile}, pays_once=True, run_samples=100)
    assert verdicts["a"]["verdict"] == "does not pay back"  # saves 50 s, costs 80 s


def test_tune_the_warm_up_is_round_0_of_the_reference():
    now = [0.0]

    def run(setup, limit, lever):
        now[0] += 1.0
        return Trial(ok=True, sample_s=1e-3)

    result = search.search([], Setup(1, 1, 8), run, budget_s=100.0, trial_s=1.0, clock=lambda: now[0])
    first = result.trials[0]
    assert (first.lever, first.label, first.round, first.wall_s) == ("warm-up", "reference", 0, 1.0)


def test_tune_a_trial_past_the_budget_gets_no_time_not_a_negative_limit():
    now, limits = [0.0], []

    def run(setup, limit, lever):
        limits.append(limit)
        return Trial(ok=True, sample_s=1e-3)

    state = search._Search(run, lambda: now[0], budget_s=100.0, trial_s=5.0, progress=lambda text: None)
    now[0] = 150.0  # 50 s over the budget
    state.measure(Setup(1, 1, 8), "warm-up", "reference", 0)
    now[0] = 40.0
    state.measure(Setup(1, 1, 8), "warm-up", "reference", 0)
    assert limits == [0.0, 60.0]


def test_tune_one_lever_runs_interleaved_rounds_and_keeps_the_faster():
    now = [0.0]

    def run(setup, limit, lever):
        now[0] += 1.0
        return Trial(ok=True, sample_s=0.5 if setup.flag("--optimizer-impl") == "foreach" else 1.0)

    lever = [lv for lv in search.levers(search.Context(cores=2)) if lv.name == "optimizer-impl"]
    result = search.search(lever, Setup(1, 2, 8), run, budget_s=100.0, trial_s=1.0, clock=lambda: now[0])
    seen = [(t.lever, t.label, t.round) for t in result.trials]
    impl = "optimizer-impl"
    one = [(impl, "current", 1), (impl, "--optimizer-impl foreach", 1), (impl, "--optimizer-impl for-loop", 1)]
    assert seen == [("warm-up", "reference", 0), *one, *[(a, b, 2) for a, b, _ in one]]
    decision = result.decisions[0]
    assert (decision["status"], decision["chosen"], decision["flags"]) == (
        "kept", "--optimizer-impl foreach", ["--optimizer-impl foreach"])
    assert result.best == Setup(1, 2, 8, flags=(("--optimizer-impl", "foreach"),))


# ---------------------------------------------------------------------- early stopping, the optimizer
from manual_train.early_stopping import EarlyStopping  # noqa: E402


def test_early_stop_a_smaller_patience_after_resume_stops_at_the_next_evaluation():
    es = EarlyStopping(patience=2)
    es.load_state_dict({"monitor": "val_loss", "best": 1.0, "best_epoch": 0, "wait": 5, "should_stop": False,
                        "reason": ""})
    assert es.update(2.0, 6) is False and es.should_stop and es.wait == 6


def test_early_stop_reasons_name_the_epoch_as_the_user_counts_it():
    """Epochs count from 1 in every line a user reads (the progress bar, metrics.csv's epoch column is 0-based)."""
    es = EarlyStopping("val_acc", patience=0, stop_at=0.9)
    es.update(0.5, 0)
    es.update(0.95, 2)
    assert es.reason == "target reached: val_acc 0.9500 at epoch 3 (--stop-at 0.9)"
    es = EarlyStopping(patience=1)
    es.update(float("nan"), 4)
    assert es.reason == "val_loss is nan at epoch 5"
    es = EarlyStopping(patience=2, min_delta=0.1)
    es.update(1.0, 0), es.update(0.95, 1), es.update(0.99, 2)
    assert es.reason == "val_loss did not improve by more than 0.1 for 2 evaluations (best 1.0000 at epoch 1)"


@pytest.mark.parametrize("mine,theirs", [("val_acc", "val_loss"), ("val_loss", "val_acc")])
def test_early_stop_another_monitors_state_is_not_taken(mine, theirs):
    es = EarlyStopping(mine)
    es.load_state_dict({"monitor": theirs, "best": 0.5, "best_epoch": 3, "wait": 2, "should_stop": False,
                        "reason": ""})
    assert es.best == (math.inf if mine == "val_loss" else -math.inf) and es.wait == 0 and es.best_epoch == -1


def optimizer_of(tmp_path, **overrides):
    cfg = make_cfg(tmp_path, model="mlp", **overrides)
    group = optim.build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))], 0.1).param_groups[0]
    return bool(group.get("foreach")), bool(group.get("fused"))


def test_optim_impl_picks_the_kernel_asked_for(tmp_path):
    assert optimizer_of(tmp_path, optimizer_impl="for-loop") == (False, False)
    assert optimizer_of(tmp_path, optimizer_impl="foreach") == (True, False)
    assert optimizer_of(tmp_path, optimizer_impl="fused") == (False, True)
    assert optimizer_of(tmp_path) == (False, True)  # the default on the CPU: fused
    assert optimizer_of(tmp_path, optimizer="adamw", optimizer_impl="fused") == (False, True)
    # 16-mixed SGD: the default falls back to foreach (config.SCALER_SKIPS_FUSED_SGD), AdamW stays fused
    assert optimizer_of(tmp_path, precision="16-mixed") == (True, False)
    assert optimizer_of(tmp_path, precision="16-mixed", optimizer="adamw") == (False, True)


def test_tune_runner_reports_a_failed_trial_by_its_error_line(tmp_path):
    from manual_train.tune import trials

    runner = trials.Runner(["--epochs", "zero"], 8, tmp_path, trial_s=1.0, accumulate=1,
                           steps_per_epoch=lambda setup: 10)
    trial = runner(Setup(1, 1, 8), 300.0, "warm-up")
    assert not trial.ok and trial.error.startswith("exit 2: error: --epochs")
    assert (tmp_path / "trial-001.log").read_text().startswith("error: --epochs")


# ---------------------------------------------------------------------- config validation (manual_train/config.py)
from manual_train import config as config_mod  # noqa: E402
from manual_train.errors import UsageError  # noqa: E402


def test_config_defaults_are_the_documented_ones():
    """The values every run gets without a flag (README, DESIGN.md's CLI contract, docs): a changed default changes
    every user's run silently."""
    cfg = config_mod.Config()
    assert (cfg.epochs, cfg.accumulate, cfg.lr, cfg.base_batch_size, cfg.num_workers) == (10, 1, 0.05, 32, 0)
    assert (cfg.synthetic_size, cfg.early_stop_min_delta, cfg.summary_depth, cfg.compile) == (2048, 0.0, 1, "none")
    assert cfg.train_acc is True and cfg.tensorboard is False and cfg.out_dir is None and cfg.val_every_steps is None


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_config_parsers_take_the_boundaries_and_refuse_past_them():
    assert config_mod.parse_duration("90", "--max-time") == 90.0
    assert config_mod.parse_duration("01:02:03:04", "--max-time") == 86400 + 2 * 3600 + 3 * 60 + 4
    assert config_mod.parse_duration(None, "--max-time") is None
    assert refused(config_mod.parse_duration, "1:2:3:4:5", "--max-time").startswith("--max-time: '1:2:3:4:5' is not")
    assert config_mod.parse_window("0:1", "--w") == (0, 1)
    assert refused(config_mod.parse_window, "3:3", "--w").startswith("--w: '3:3' is not a window")
    assert refused(config_mod.parse_window, "1:2:3", "--w").startswith("--w: ")
    assert config_mod.parse_shape("1,1,1", "--s") == (1, 1, 1)
    assert refused(config_mod.parse_shape, "1,1", "--s") == \
        "--s: '1,1' is not three positive integers (allowed: C,H,W such as 3,32,32)"
    assert refused(config_mod.parse_shape, "1,0,1", "--s").startswith("--s: '1,0,1'")
    assert config_mod.parse_limit(None, "--l") is None and config_mod.parse_limit("1", "--l") == 1
    assert config_mod.parse_limit("1.0", "--l") == 1.0 and config_mod.parse_limit("0.5", "--l") == 0.5
    assert refused(config_mod.parse_limit, "0", "--l").startswith("--l: 0 is out of range")
    assert refused(config_mod.parse_limit, "1.5", "--l").startswith("--l: 1.5 is out of range")
    assert refused(config_mod.parse_signals, "KILL", "--sig") == \
        "--sig: SIGKILL cannot be caught (allowed: TERM, USR1, USR2, HUP, or none)"


def test_config_numbers_and_flags_as_the_user_types_them():
    assert config_mod._number(2.0 ** 64) == "2**64" and config_mod._number(2.0 ** 25) == "2**25"
    assert config_mod._number(2.0 ** 24) == "2**24" and config_mod._number(2.0 ** 23) == "8.38861e+06"
    assert config_mod._number(1e7) == "1e+07"
    assert config_mod._number(2147483647) == "2147483647"
    assert config_mod._flag("early_stop_min_delta") == "--early-stop-min-delta"


def test_config_lower_bounds_refuse_the_first_value_past_them(tmp_path):
    """The bounds arg() declares, at the edge: --base-batch-size 0 would divide --lr by zero (--lr-scaling), and a
    --grad-clip of 0 would zero every gradient (its bound is exclusive)."""
    assert make_cfg(tmp_path, base_batch_size=1).base_batch_size == 1
    assert refused(make_cfg, tmp_path, base_batch_size=0).startswith("--base-batch-size: 0 ")
    assert make_cfg(tmp_path, grad_clip=1e-12).grad_clip == 1e-12
    assert refused(make_cfg, tmp_path, grad_clip=0.0) == "--grad-clip: 0.0 is out of range (allowed: > 0)"


@pytest.mark.parametrize("name", ["tpu", "amd", "cud", "cuda0"])  # after and before "cuda" in sort order
def test_config_an_unknown_device_name_is_named_as_unknown(name):
    assert refused(config_mod.check_device_name, name, "--device") == \
        f"--device: unknown device {name!r} (allowed: auto, cpu, cuda, cuda:N)"


def test_config_a_cuda_device_past_the_hosts_is_refused():
    """Host-dependent: without CUDA every cuda name is refused as unavailable; with n devices, cuda:n is refused."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    line = refused(config_mod.check_device_name, f"cuda:{n}", "--device")
    assert line == (f"--device: cuda:{n} requested but only {n} CUDA device(s) exist (allowed: auto, cpu, cuda, cuda:N)"
                    if n else "--device: cuda:0 requested but CUDA is not available on this machine (allowed: auto, cpu)")
    if n:
        config_mod.check_device_name(f"cuda:{n - 1}", "--device")  # the last one is taken


def test_config_cross_flag_checks(tmp_path):
    with pytest.raises(UsageError, match="--persistent-workers: needs worker processes"):
        make_cfg(tmp_path, persistent_workers=True)
    with pytest.raises(UsageError, match="--prefetch-factor: needs worker processes"):
        make_cfg(tmp_path, prefetch_factor=2)
    assert make_cfg(tmp_path, num_workers=1, persistent_workers=True, prefetch_factor=2).num_workers == 1
    cfg = make_cfg(tmp_path, fast_dev_run=True, epochs=3)
    assert (cfg.max_steps, cfg.limit_train_batches, cfg.limit_val_batches) == (1, "1", "1")
    with pytest.raises(UsageError) as e:
        make_cfg(tmp_path, optimizer_impl="fused", optimizer="sgd", precision="16-mixed")
    assert str(e.value).startswith("--optimizer-impl: ") and str(e.value).endswith(
        "(allowed: foreach, for-loop, or --optimizer adamw)")
    assert make_cfg(tmp_path, optimizer_impl="fused", optimizer="adamw", precision="16-mixed").optimizer_impl == "fused"
    assert make_cfg(tmp_path, optimizer_impl="foreach", optimizer="sgd", precision="16-mixed").optimizer == "sgd"


@pytest.mark.parametrize("argv,line", [
    (["--optimizer", "x"], "error: --optimizer: invalid choice: 'x' (allowed: 'sgd', 'adamw')"),
    (["--epoch", "3"], "error: --epoch: unknown flag or stray argument '--epoch 3' (see --help)"),  # no abbreviations
])
def test_config_parse_errors_are_the_one_line_the_user_reads(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        config_mod.parse_config(argv=argv)
    assert e.value.code == 2 and capsys.readouterr().err == line + "\n"


# ---------------------------------------------------------------------- data (manual_train/data.py)
from manual_train import data as data_mod  # noqa: E402


def test_data_digits_pixels_span_minus_one_to_one_and_the_split_is_1500_297():
    train, val = data_mod.load_digits_split()
    x = torch.cat([train.tensors[0], val.tensors[0]])
    assert (len(train), len(val)) == (1500, 297) and x.shape[1:] == (1, 8, 8)
    assert x.min().item() == -1.0 and x.max().item() == 1.0  # scikit-learn's pixels are 0..16
    assert sorted(set(torch.cat([train.tensors[1], val.tensors[1]]).tolist())) == list(range(10))


def test_data_reverse_reads_digits_and_writes_them_reversed_after_bos():
    ds = data_mod.ReverseDigits(512, seed=3)
    x, y = ds[0]
    assert x.shape == (2, 8) and y.shape == (8,)  # the default length
    src, dec = ds.x[:, 0], ds.x[:, 1]
    assert sorted(set(src.flatten().tolist())) == list(range(10))  # every digit, nothing else
    assert torch.equal(ds.y, src.flip(1)) and torch.equal(dec[:, 1:], ds.y[:, :-1])
    assert (dec[:, 0] == ds.BOS).all() and ds.BOS not in range(10) and ds.BOS == ds.VOCAB - 1  # BOS: the id after the digits


@pytest.mark.parametrize("dataset,flags,sizes,info", [
    ("digits", {}, (1500, 297), ("digits", (1, 8, 8), 10)),
    ("synthetic", dict(synthetic_size=40, synthetic_shape="2,3,4", synthetic_classes=5), (40, 10), ("synthetic", (2, 3, 4), 5)),
    ("synthetic", dict(synthetic_size=3, synthetic_shape="1,4,4", synthetic_classes=2), (3, 1), ("synthetic", (1, 4, 4), 2)),
    ("reverse", dict(synthetic_size=40), (40, 10), ("reverse", (2, 8), 11)),
])
def test_data_each_dataset_is_its_sizes_shapes_and_classes(tmp_path, dataset, flags, sizes, info):
    """build_datasets' (train, val, info) as the models and the banner read them: val is a quarter of train (at least
    one sample), drawn from another seed; every sample has info's shape and a label inside its classes."""
    model = "seq2seq" if dataset == "reverse" else "mlp"
    train, val, got = data_mod.build_datasets(make_cfg(tmp_path, dataset=dataset, model=model, **flags))
    assert (len(train), len(val)) == sizes and (got.name, got.input_shape, got.num_classes) == info
    for ds in (train, val):
        x, y = ds[len(ds) - 1]
        assert tuple(x.shape) == info[1] and 0 <= int(torch.as_tensor(y).max()) < info[2]
    assert not torch.equal(train[0][0], val[0][0])
    if dataset == "synthetic" and len(train) >= 40:  # the labels cover --synthetic-classes, no more
        assert {int(train[i][1]) for i in range(len(train))} == set(range(info[2]))


def test_data_loader_pins_by_default_for_cuda_only_and_as_asked_otherwise(tmp_path):
    """--pin-memory's default: pinned for a CUDA device; never for the CPU, even when asked (a pinned copy there
    costs a copy and buys nothing). The loader's own attribute, whatever this host has."""
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    pinned = {(name, flag): data_mod.build_loader(ds, make_cfg(tmp_path, pin_memory=flag), torch.device(name),
                                                  batch_size=2).pin_memory
              for name in ("cpu", "cuda") for flag in (None, True, False)}
    assert pinned == {("cpu", None): False, ("cpu", True): False, ("cpu", False): False,
                      ("cuda", None): True, ("cuda", True): True, ("cuda", False): False}


# ---------------------------------------------------------------------- metrics.csv (manual_train/metrics.py)
def test_metrics_a_resume_keeps_the_rows_up_to_its_step_and_drops_the_later_ones(tmp_path):
    """The crashed run logged steps 1..5 (train and val rows), its checkpoint is at step 3: the resumed log keeps
    steps 1..3, both splits, in order, and goes on after step 3."""
    import csv

    from manual_train.metrics import CSV_COLUMNS, RunLog

    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows({"step": s, "epoch": 0, "split": split} for s in range(1, 6) for split in ("train", "val"))
    log = RunLog(tmp_path, resume_step=3)
    assert log.last_step == 3
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        kept = [(int(r["step"]), r["split"]) for r in csv.DictReader(f)]
    assert kept == [(s, split) for s in (1, 2, 3) for split in ("train", "val")]


def test_metrics_tensorboard_gets_each_rows_values_at_its_step(tmp_path, monkeypatch):
    """RunLog.row's scalars (a recording SummaryWriter: the tensorboard package is an optional extra): loss and acc
    of each split at the row's step, the learning rate for training rows only."""
    import sys
    import types

    from manual_train.metrics import RunLog

    written = []
    writer = types.SimpleNamespace(add_scalar=lambda tag, value, step: written.append((tag, value, step)),
                                   close=lambda: None, flush=lambda: None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=lambda d: writer))
    log = RunLog(tmp_path / "run", tensorboard=True)
    log.row(step=7, epoch=0, split="train", loss=0.5, acc=0.25, lr=0.1, samples_per_s=1.0, time_s=1.0)
    log.row(step=9, epoch=0, split="val", loss=0.75, acc=0.125, lr=0.1, samples_per_s=1.0, time_s=2.0)
    assert written == [("train/loss", 0.5, 7), ("train/acc", 0.25, 7), ("train/lr", 0.1, 7),
                       ("val/loss", 0.75, 9), ("val/acc", 0.125, 9)]


def test_metrics_a_claimed_folder_without_rows_is_discarded_and_one_with_a_row_is_kept(tmp_path):
    """discard_unstarted_runs: a run that failed before its first row leaves no folder (it would block the next try
    as "already holds a run"); one row, and the folder is a run's. A metrics.csv cut before its header also goes."""
    from manual_train import metrics

    started, unstarted, cut = (metrics.RunLog(tmp_path / name) for name in ("started", "unstarted", "cut"))
    started.row(step=1, epoch=0, split="train", loss=1.0, acc=0.0, lr=0.1, samples_per_s=1.0, time_s=1.0)
    (tmp_path / "cut" / "metrics.csv").write_text("")
    metrics.discard_unstarted_runs()  # the runs failed: none was closed (a closed log is a finished run's)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started"]
    for log in (started, unstarted, cut):
        os.close(log._fd)


def test_data_windows_count_each_micro_batch_and_its_whole_window(tmp_path):
    """Windows.count on one rank, 10 samples of one target each, micro-batches of 2, windows of 2 micro-batches:
    the epoch's last window holds what is left (micro-batch 4 alone: 2 samples)."""
    ds = torch.utils.data.TensorDataset(torch.zeros(10, 1), torch.zeros(10, dtype=torch.long))
    windows = data_mod.Windows(ds, data_mod.train_sampler(ds, 0), make_cfg(tmp_path, batch_size=2, accumulate=2))
    assert [windows.count(k) for k in range(5)] == [(2, 4), (2, 4), (2, 4), (2, 4), (2, 2)]


def test_metrics_model_summary_has_a_row_per_module_from_depth_1_to_its_depth():
    """The banner's summary (--summary-depth): never the root (depth 0), every submodule down to max_depth."""
    import torch.nn as nn

    from manual_train.metrics import model_summary

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), nn.Linear(3, 1))

    def names(depth):
        return [line.split()[0] for line in model_summary(model, depth).splitlines()[1:-1]]
    assert (names(0), names(1), names(2), names(3)) == ([], ["0", "1"], ["0", "0.0", "0.1", "1"], ["0", "0.0", "0.1", "1"])


def test_metrics_summary_best_epoch_counts_from_1_and_is_none_before_any_evaluation():
    from manual_train.early_stopping import EarlyStopping
    from manual_train.metrics import run_summary

    def best_epoch(early):
        return run_summary(script="s", world_size=1, device="cpu", cfg=config_mod.Config(), global_batch_size=1,
                           epoch=0, step=1, samples_seen=1, samples_this_run=1, val_loss=1.0, val_acc=0.0, best={},
                           early=early, skipped_steps=0, wall_s=1.0, data_wait_s=0.0, peak_mem_bytes=0,
                           checkpoint=None)["best_epoch"]
    early = EarlyStopping()
    assert best_epoch(early) is None
    early.update(1.0, 0)
    assert best_epoch(early) == 1


def test_run_a_pt_checkpoint_loads_whole_even_into_a_sharded_model_and_a_dcp_folder_into_its_shards(tmp_path):
    """Run._load_model_optimizer: a .pt checkpoint is read whole (load_state_dict) whatever the model; only a dcp
    checkpoint goes into a sharded model's shards (here DCP in one process: a Linear whose `sharded` is itself)."""
    import warnings

    from manual_train import checkpoint
    from manual_train.run import Run

    class Sharded(torch.nn.Linear):
        @property
        def sharded(self):
            return self, self.optimizer

    torch.manual_seed(0)
    source = torch.nn.Linear(3, 2)
    source_opt = torch.optim.Adam(source.parameters())
    source(torch.randn(4, 3)).sum().backward()
    source_opt.step()
    target = Sharded(3, 2)
    target.optimizer = torch.optim.Adam(target.parameters())
    Run._load_model_optimizer(None, {"model": source.state_dict(), "optimizer": source_opt.state_dict()},
                              target, target.optimizer)
    assert torch.equal(target.weight, source.weight) and target.optimizer.state_dict()["state"][0]["step"] == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        rest, _ = checkpoint.save_sharded(source, source_opt, tmp_path / "shards")
        target = Sharded(3, 2)
        target.optimizer = torch.optim.Adam(target.parameters())
        Run._load_model_optimizer(None, {"format": "dcp", "dcp": str(tmp_path / "shards"), "rest": rest}, target,
                                  target.optimizer)
    assert torch.equal(target.weight, source.weight) and target.optimizer.state_dict()["state"][0]["step"] == 1


def test_run_validation_rows_report_no_throughput_and_training_rows_do(tmp_path):
    import csv

    from manual_train.loops import single

    single.train(make_cfg(tmp_path, model="mlp", epochs=1, limit_train_batches="3", log_every=1))
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert {r["split"] for r in rows} == {"train", "val"}
    assert all(float(r["samples_per_s"]) == 0.0 for r in rows if r["split"] == "val")
    assert all(float(r["samples_per_s"]) > 0.0 for r in rows if r["split"] == "train")


def test_run_signal_notices_ride_a_gloo_default_group_without_a_group_of_their_own(monkeypatch):
    """--save-on-signal: the ranks agree on a notice with a CPU tensor; under gloo the default group carries it (no
    second group to create and keep); under nccl a gloo group of its own (a GPU host's test)."""
    import signal
    import types

    import torch.distributed as dist

    from manual_train import run as run_module

    monkeypatch.setattr(run_module, "catch_notices", lambda signals: None)  # no handlers in pytest's process
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = types.SimpleNamespace(signals=(signal.SIGUSR1,), distributed=True, signal_group="unset")
        run_module.Run._catch_signals(run)
        assert run.signal_group is None
    finally:
        dist.destroy_process_group()


def test_run_summary_names_why_a_run_stopped_early_max_time_or_a_notice(tmp_path, monkeypatch):
    """summary.json's stop_reason and signal: --max-time's stop after 1 s of a 2000-step run; a notice recorded
    before the first step (as a preemption during set-up is) stops the run after it, named. With --save-on-signal
    none, the same recorded notice is none of the run's business: it trains to its end."""
    import json
    import signal

    from manual_train import run as run_module
    from manual_train.loops import single

    monkeypatch.setattr(run_module, "catch_notices", lambda signals: None)  # no handlers in pytest's process
    flags = dict(model="mlp", log_every=100, eval_every=100)
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "timed"), max_time="1", max_steps=2000,
                          save_on_signal="none", **flags))
    summary = json.loads((tmp_path / "timed" / "summary.json").read_text())
    assert summary["stop_reason"].startswith("--max-time 1 reached after step "), summary["stop_reason"]
    assert "signal" not in summary and summary["optimizer_steps"] < 2000

    monkeypatch.setattr(run_module, "_notice", [int(signal.SIGUSR1)])  # as _record_notice leaves it
    from manual_train.errors import Preempted

    with pytest.raises(Preempted, match="stopped by SIGUSR1 after step 1"):  # cli.run makes it exit status 75
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "noticed"), max_steps=20, save_on_signal="USR1",
                              **flags))
    summary = json.loads((tmp_path / "noticed" / "summary.json").read_text())
    assert (summary["stop_reason"], summary["signal"], summary["optimizer_steps"]) == ("signal", "SIGUSR1", 1)

    monkeypatch.setattr(run_module, "_notice", [int(signal.SIGUSR1)])
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "deaf"), max_steps=20, save_on_signal="none", **flags))
    summary = json.loads((tmp_path / "deaf" / "summary.json").read_text())
    assert "signal" not in summary and summary["optimizer_steps"] == 20


def plugin_module(tmp_path, monkeypatch, name: str, source: str):
    """A user's plug-in module `name` (its source written into tmp_path, importable from there); returns a config of
    the mlp on digits in tmp_path for the checks to read."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return make_cfg(tmp_path, model="mlp")


def test_plugin_a_missing_package_is_the_users_typo_and_a_plugins_own_missing_import_is_theirs(tmp_path, monkeypatch):
    """A spec whose package is missing is one UsageError line; a plug-in module that exists but itself imports a
    missing module raises that ModuleNotFoundError (their traceback), whatever the names' sort order."""
    from manual_train import plugins
    from manual_train.errors import UsageError

    with pytest.raises(UsageError, match=r"--model: cannot import no_such_pkg\.sub \(no module named no_such_pkg;"):
        plugins.load("no_such_pkg.sub:build", "--model")
    plugin_module(tmp_path, monkeypatch, "aaa_plugin", "import zzz_missing_dependency\n\ndef build(info):\n    pass\n")
    with pytest.raises(ModuleNotFoundError, match="zzz_missing_dependency"):
        plugins.load("aaa_plugin:build", "--model")


def test_plugin_loss_whose_sum_is_off_by_half_a_unit_is_refused(tmp_path, monkeypatch):
    """check_loss: "sum" must be "mean" x the targets to 1e-9 relative (1e-12 absolute near 0); a sum 0.5 off, on
    two targets, is refused naming both numbers."""
    from manual_train import data, plugins
    from manual_train.errors import UsageError
    from manual_train.models import IGNORE

    cfg = plugin_module(
        tmp_path, monkeypatch, "offloss",
        "import torch.nn.functional as F\n\n"
        "def loss(logits, y, reduction='mean'):\n"
        "    out = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)\n"
        "    return out + 0.5 if reduction == 'sum' else out\n")
    train, _, info = data.build_datasets(cfg)
    cfg.loss = "offloss:loss"
    with pytest.raises(UsageError, match=r"--loss: offloss:loss's sum \(.*\) is not its mean x the 2 targets"):
        plugins.check_loss(cfg, info, train, IGNORE)


def test_plugin_datasets_refuse_a_set_without_len_and_name_the_class_ids_allowed(tmp_path, monkeypatch):
    """build_datasets: a split with __getitem__ but no __len__ is not map-style (both are needed); a first target
    equal to num_classes is refused naming the ids allowed, 0..num_classes-1."""
    from manual_train import plugins
    from manual_train.errors import UsageError
    from manual_train.models import DataInfo

    cfg = plugin_module(
        tmp_path, monkeypatch, "sets",
        "import torch\n\n"
        "class NoLen:\n"
        "    def __getitem__(self, i):\n"
        "        return torch.zeros(2), 0\n\n"
        "class Two:\n"
        "    def __init__(self, y):\n"
        "        self.y = y\n"
        "    def __len__(self):\n"
        "        return 2\n"
        "    def __getitem__(self, i):\n"
        "        return torch.zeros(2), self.y\n\n"
        "def no_len(cfg):\n"
        "    return NoLen(), Two(0), {'num_classes': 3, 'input_shape': (2,)}\n\n"
        "def class_3_of_3(cfg):\n"
        "    return Two(3), Two(0), {'num_classes': 3, 'input_shape': (2,)}\n")
    cfg.dataset = "sets:no_len"
    with pytest.raises(UsageError, match=r"sets:no_len's train set is a NoLen, not a map-style dataset"):
        plugins.build_datasets(cfg, DataInfo)
    cfg.dataset = "sets:class_3_of_3"
    with pytest.raises(UsageError, match=r"first sample's target 3 is not a class id in 0\.\.2 \("):
        plugins.build_datasets(cfg, DataInfo)


@pytest.mark.parametrize("message,reason", [("mat1 and mat2 shapes cannot be multiplied\n(the second line)",
                                             "mat1 and mat2 shapes cannot be multiplied"), ("", "RuntimeError")])
def test_plugin_a_model_that_cannot_take_the_samples_names_the_first_line_of_why(tmp_path, monkeypatch, message,
                                                                                 reason):
    """check_fits: the forward's RuntimeError in one line, its first; an error without a message by its type."""
    from manual_train import data, plugins
    from manual_train.errors import UsageError

    name = f"failing_{len(message)}"  # a module per case: the import system keeps the first one
    cfg = plugin_module(
        tmp_path, monkeypatch, name,
        "import torch\n\n"
        "class Fails(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        f"        raise RuntimeError({message!r})\n\n"
        "def build(info):\n"
        "    return Fails()\n")
    train, _, info = data.build_datasets(cfg)
    cfg.model = f"{name}:build"
    with pytest.raises(UsageError) as e:
        plugins.check_fits(cfg, info, train)
    assert str(e.value).endswith(f"(one forward pass fails: {reason})"), str(e.value)


def test_tokens_validation_is_a_quarter_of_the_training_set_and_never_empty():
    from manual_train.tokens import reverse_lm_datasets

    assert [len(reverse_lm_datasets(n)[1]) for n in (3, 4, 100)] == [1, 1, 25]


def test_parity_progress_lines_come_while_it_runs_and_only_when_a_run_moved(tmp_path):
    """The tool's progress (without --quiet), on a user's loop that records its own trace (parity.record, no total
    of steps to show): each line is flushed as it is printed (read here seconds before the report), a line comes only
    when a run has moved (both runs sleep 6 s after step 2: one line for it, not one every 2 s), and the pair of
    equal runs is reported equal."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    loop = tmp_path / "loop.py"
    loop.write_text(
        "import argparse, time\nimport torch\nfrom manual_train import parity\n\n"
        "p = argparse.ArgumentParser()\n"
        "for flag in ('--trace-dir', '--out-dir', '--precision'):\n"
        "    p.add_argument(flag)\n"
        "args = p.parse_args()\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(3, 2).double()\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x = torch.randn(8, 3, dtype=torch.float64)\n"
        "parity.record(model, 0, args.trace_dir)\n"
        "for step in range(1, 5):\n"
        "    loss = model(x).square().mean()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
        "    parity.record(model, step, args.trace_dir, loss=loss)\n"
        "    if step == 2:\n"
        "        time.sleep(6)\n")
    command = f"python {loop} --precision 64-true"  # (64-true in A's command: no noise-floor run)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout a pipe, block-buffered
    proc = subprocess.Popen([sys.executable, "-m", "manual_train.parity", "--work-dir", str(tmp_path / "w"),
                             "--a", command, "--b", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append((line.rstrip("\n"), time.monotonic()))
    finally:
        proc.kill()
        proc.wait()
    text = "\n".join(line for line, _ in lines)
    assert proc.returncode == 0 and "equal within 1e-09 over 5 steps (0-4)" in text, text
    progress = [(line, t) for line, t in lines if line.startswith("training: ")]
    report_at = next(t for line, t in lines if line.startswith("equal within"))
    assert progress and progress[0][1] < report_at - 2, text  # read seconds before the report: each line flushed
    assert all(line == f"training: A step {a}, B step {b}" for line, _ in progress
               for a, b in [re.match(r"training: A step (\d+), B step (\d+)$", line).groups()]), text
    assert "training: A step 2, B step 2" in text, text
    assert all(x[0] != y[0] for x, y in zip(progress, progress[1:])), text  # a line only when a run moved


def test_parity_a_mixed_precision_run_gets_no_noise_floor_run(tmp_path):
    """The floor is 32-true's: for A in 16-mixed the third run is never started (it starts once A has said its
    precision, and only for 32-true), and the verdict says no fixed bound holds. (It was started with A and stopped
    later: on a quiet machine it could finish first, 188 of 188 steps, and make this check depend on the scheduler.)"""
    import subprocess
    import sys

    from conftest import REPO

    flags = ("launch/single.py --dataset synthetic --synthetic-size 400 --synthetic-shape 1,8,8 --model mlp "
             "--precision 16-mixed --epochs 2 --batch-size 24 --no-progress")
    proc = subprocess.run([sys.executable, "-m", "manual_train.parity", "--quiet", "--work-dir", str(tmp_path / "w"),
                           "--a", flags, "--b", flags], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("no verdict (16-mixed)"), proc.stdout + proc.stderr
    assert (tmp_path / "w" / "a" / "steps.jsonl").read_text().count("\n") == 35  # to its end: step 0, 2 x 17 steps
    assert not (tmp_path / "w" / "floor.log").exists()  # the floor run never started


def test_run_dcp_shards_a_zip_writer_refused_become_one_storage_line_and_the_folder_goes(tmp_path):
    """Run._shards_into: torch's zip-writer error without its OSError (as DCP's gather hands it over) is read from
    the folder (here a disk with room: EIO), the new, unlinked folder is removed, and the line names last.dcp."""
    import errno
    from types import SimpleNamespace

    from manual_train.errors import StorageError
    from manual_train.run import Run

    folder = tmp_path / ".dcp-00000003"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(StorageError) as e:
        with Run._shards_into(SimpleNamespace(out_dir=tmp_path), folder):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert e.value.errno == errno.EIO and not folder.exists()
    assert str(e.value).startswith(f"I/O error writing {tmp_path / 'last.dcp'} (new shards in .dcp-00000003); "), e
