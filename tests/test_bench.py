"""The benchmark (manual_train/bench): end to end through its CLI, its measuring parts, its GPU code on the CPU.

No timing assertions: what is asserted is the output's shape, that every ratio is the finite quotient
of the raw numbers it came from, that peak-RSS deltas see a known allocation, and that counted FLOPs
equal the closed-form count. GPU-marked tests check the sync counts and FLOPs on CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import REPO, cuda_devices
from manual_train.bench import cli, gpu, harness
from manual_train.bench.harness import ChildFailed, Goal, fresh_process, ratio_row, single_config, value_row

TINY_GPT = dict(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

# Process-wide switches the GPU entries flip (set_tf32, cudnn.benchmark): each test must leave them as it found
# them, also when it fails half-way, or every later test in the session runs with another precision.
BACKEND_FLAGS = {"matmul.allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
                 "cudnn.allow_tf32": (torch.backends.cudnn, "allow_tf32"),
                 "cudnn.benchmark": (torch.backends.cudnn, "benchmark"),
                 "cudnn.deterministic": (torch.backends.cudnn, "deterministic")}


def backend_flags() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 announces allow_tf32's deprecation
        flags = {label: getattr(obj, name) for label, (obj, name) in BACKEND_FLAGS.items()}
    flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    flags["deterministic_algorithms"] = (torch.are_deterministic_algorithms_enabled(),
                                         torch.is_deterministic_algorithms_warn_only_enabled())
    return flags


@contextlib.contextmanager
def saved_backend_flags():
    """TF32, cuDNN and determinism switches restored on the way out, however the body exits."""
    saved = backend_flags()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for label, (obj, name) in BACKEND_FLAGS.items():
                setattr(obj, name, saved[label])
        torch.set_float32_matmul_precision(saved["float32_matmul_precision"])  # after allow_tf32, which sets it too
        enabled, warn_only = saved["deterministic_algorithms"]
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(autouse=True)
def restore_backend_flags():
    with saved_backend_flags():
        yield


def test_backend_flags_are_restored_after_a_failing_body():
    before = backend_flags()
    with pytest.raises(RuntimeError, match="half-way"):
        with saved_backend_flags():
            gpu.set_tf32(not before["matmul.allow_tf32"])
            torch.backends.cudnn.benchmark = not before["cudnn.benchmark"]
            torch.use_deterministic_algorithms(True, warn_only=True)
            changed = backend_flags()
            assert all(changed[k] != before[k] for k in ("matmul.allow_tf32", "cudnn.benchmark",
                                                         "float32_matmul_precision", "deterministic_algorithms"))
            raise RuntimeError("failed half-way")
    assert backend_flags() == before


# ---------------------------------------------------------------------- end to end
def test_quick_run_writes_table_json_and_chart(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "manual_train.bench", "--quick", "--repeats", "1",
                           "--only", "data_io,loop_overhead", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]

    doc = json.loads((out / "bench.json").read_text())
    assert doc["schema"] == 1 and doc["suite"] == "cpu" and doc["quick"] is True
    assert "--only data_io,loop_overhead" in doc["command"]
    machine = doc["machine"]
    for key in ("date", "cpu_model", "cpu_count", "cpus_usable", "torch", "python", "load_avg_1_5_15"):
        assert machine[key], key
    assert machine["torch"] == torch.__version__.split("+")[0]
    assert machine["cuda"]["available"] == torch.cuda.is_available()
    assert [e["name"] for e in doc["entries"]] == ["data_io", "loop_overhead"]
    assert all(e["status"] == "ok" and e["wall_s"] > 0 for e in doc["entries"])

    rows = doc["rows"]
    assert {r["entry"] for r in rows} == {"data_io", "loop_overhead"}
    for r in rows:
        assert r["kind"] in ("ratio", "value") and r["n"] == len(r["values"]) >= 1
        assert all(isinstance(v, float) and math.isfinite(v) for v in r["values"]), r
        assert r["min"] <= r["median"] <= r["max"]
        if r["kind"] == "ratio":  # each ratio is variant / baseline of the same repeat
            expected = [v / b for b, v in zip(r["baseline_values"], r["variant_values"])]
            assert r["values"] == pytest.approx(expected, rel=1e-12)
            assert all(v > 0 for v in r["baseline_values"] + r["variant_values"])
        if r["goal"] is not None:
            value, op = r["goal"]["value"], r["goal"]["op"]
            assert r["met"] == (r["median"] <= value if op == "<=" else r["median"] >= value)
    io = next(e for e in doc["entries"] if e["name"] == "data_io")["raw"]
    w4 = next(r for r in rows if r["variant"] == "num_workers=4")
    assert w4["baseline_values"] == io["workers=0"] and w4["variant_values"] == io["workers=4"]
    assert w4["goal"] == {"op": ">=", "value": 3.2} and w4["better"] == "higher"
    overhead = next(r for r in rows if r["entry"] == "loop_overhead")
    assert overhead["goal"] == {"op": "<=", "value": 1.10}  # the mlp row (train loss and accuracy logged)

    table = (out / "bench.md").read_text()
    assert "| entry | baseline | variant |" in table
    assert sum(line.startswith("| data_io |") or line.startswith("| loop_overhead |")
               for line in table.splitlines()) == len(rows)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "logs" / "data_io.log").stat().st_size > 0


# ---------------------------------------------------------------------- bad input
def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["--only", "nope", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: no entry 'nope' in --suite cpu (allowed: data_io, loop_overhead")
    assert err.count("\n") == 1
    assert cli.main(["--repeats", "0", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == "error: --repeats: 0 is out of range (allowed: >= 1)\n"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "bench.json").write_text("{}")
    assert cli.main(["--out", str(tmp_path / "c")]) == 2
    assert "already holds bench.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing created by the refused runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is absent")
def test_gpu_suite_without_cuda_says_so(tmp_path, capsys):
    assert cli.main(["--suite", "gpu", "--quick", "--out", str(tmp_path / "g")]) == 2
    assert capsys.readouterr().err == ("error: --suite: gpu needs a CUDA device and torch.cuda.is_available() is "
                                       "False here (allowed: cpu)\n")
    assert not (tmp_path / "g").exists()


# ---------------------------------------------------------------------- the measuring parts
def test_rows_pair_repeats_and_judge_goals():
    row = ratio_row("e", "A", "B", "time", [2.0, 4.0, 1.0], [1.0, 1.0, 1.0], goal=Goal("<=", 0.5))
    assert row.values == [0.5, 0.25, 1.0]  # paired by repeat, not median(B) / median(A)
    assert (row.median, row.spread, row.met) == (0.5, (0.25, 1.0), True)
    assert ratio_row("e", "A", "B", "t", [1.0], [0.6], goal=Goal("<=", 0.5)).met is False
    assert value_row("e", "-", "B", "MB", [3.0], goal=Goal(">=", 3.2)).met is False
    assert value_row("e", "-", "B", "MB", [float("nan")], goal=Goal(">=", 3.2)).met is None


def test_speedups_entry_is_registered_with_a_short_sane_config():
    """speedups_vs_naive (manual_train/bench/speedups.py): registered, every speed-up is one of the project's own
    flags, the timed windows fit in the first epoch, compile only where it pays (the GPT), and the naive loop and
    the step clock run (on the cnn: no compiling in make test)."""
    from manual_train import data
    from manual_train.bench import cpu, speedups

    assert cpu.ENTRIES["speedups_vs_naive"][0] is speedups.speedups_vs_naive
    for case, c in speedups.CASES.items():
        cfg = single_config(*c["flags"], *c["speedups"])  # parses: a UsageError here would exit
        train_ds, _, _ = data.build_datasets(cfg)
        assert 0 < c["first"] < c["last"] <= data.steps_per_epoch(len(train_ds), cfg.batch_size, 1), case
        assert (c["last"] - c["first"]) % c["block"] == 0 and cfg.epochs == 1
        assert (cfg.compile != "none") == (case == "gpt") and cfg.optimizer_impl == "fused"
    step_s = speedups._naive_step_s("cnn")
    assert 0 < step_s < 1.0


def test_compile_pydoc_entry_counts_real_targets_and_builds_rows(tmp_path, monkeypatch, one_thread):
    """compile_pydoc (manual_train/bench/levers.py): registered; its child (compile_speed's, run here in this process
    and eager only: compiling takes tens of seconds) trains on the loop's first micro-batches of --dataset pydoc and
    counts their real targets, padding excluded, as an independent count over the sampler's indices does; the rows
    are tokens/s = those targets per step / seconds per step, and their ratios to eager."""
    from manual_train import data
    from manual_train.bench import cpu, levers
    from manual_train.models import IGNORE

    assert cpu.ENTRIES["compile_pydoc"][0] is levers.compile_pydoc

    class EagerOnlyBench(harness.Bench):
        def child(self, fn, *, timeout_s=600, **kwargs):
            with monkeypatch.context() as m:
                m.setattr(levers, "COMPILE", ("none",))
                result = fn(**kwargs)
            for mode in ("model", "blocks"):  # the compiled sides: eager's numbers (the arithmetic is checked)
                result["step_s"][mode], result["first_step_s"][mode] = result["step_s"]["none"], 0.5
            return result

    bench = EagerOnlyBench(suite="cpu", quick=True, threads=1, log_dir=tmp_path, repeats_override=1,
                           entry="compile_pydoc")
    outcome = levers.compile_pydoc(bench)
    raw, batch = outcome.raw, 32
    train_ds, _, _ = data.build_datasets(single_config("--model", "gpt", "--dataset", "pydoc"))
    sampler = data.train_sampler(train_ds, 0)
    sampler.set_epoch(0)
    order = list(sampler)
    expected = [int((train_ds.y[order[k * batch:(k + 1) * batch]] != IGNORE).sum())
                for k in range(levers.PYDOC_BATCHES)]
    assert raw["targets"] == expected and min(expected) <= raw["targets_per_step"] <= batch * 64
    assert raw["epoch_targets_per_sample"] == pytest.approx(train_ds.targets_per_sample.double().mean().item())
    ratios = [r for r in outcome.rows if r.kind == "ratio"]
    assert [r.variant for r in ratios] == ["--compile model", "--compile blocks"]
    assert all(r.better == "higher" and r.values == [1.0] for r in ratios)
    rates = [r for r in outcome.rows if r.unit == "tok/s"]
    assert [r.variant for r in rates] == ["eager", "--compile model", "--compile blocks"]
    assert rates[0].values == pytest.approx([raw["targets_per_step"] / t for t in raw["step_s"]["none"]])
    assert all(math.isfinite(v) and v > 0 for r in outcome.rows for v in r.values)


def test_time_to_target_stops_every_configuration_at_the_target(tmp_path, monkeypatch):
    """time_to_target (manual_train/bench/time_to_target.py): registered; its MNIST-shaped files load as 28x28
    digits; with a fake tune.json (the tuner's contract) and a low target on 8x8 digits, the naive loop, the defaults
    and the tuned command (python for torchrun's spelling too) each stop at their first evaluation at or above the
    target, and the rows are the naive time over each configuration's."""
    from manual_train import data
    from manual_train.bench import cpu
    from manual_train.bench import time_to_target as ttt

    assert cpu.ENTRIES["time_to_target"][0] is ttt.time_to_target
    ttt._write_data_child(str(tmp_path / "mnist"))
    train_ds, val_ds, info = data.build_datasets(single_config("--dataset", "mnist", "--data-root",
                                                               str(tmp_path / "mnist")))
    assert (len(train_ds), len(val_ds), info.input_shape) == (1500, 297, (1, 28, 28))

    fake = {"command": {"env": {"OMP_NUM_THREADS": "1"},
                        "argv": ["python", "launch/single.py", "--model", "cnn", "--dataset", "digits",
                                 "--batch-size", "64", "--optimizer-impl", "fused"]},
            "exact": [{"lever": "layout", "status": "kept", "chosen": "1 rank x 1 thread",
                       "candidates": [{"label": "1 rank x 1 thread", "speed": 2.5, "noise": 0.1}]},
                      {"lever": "compile", "status": "skipped", "reason": "too short"}], "changes": []}
    assert ttt.tuned_command({"command": {"argv": ["torchrun", "--nproc_per_node", "2", "launch/ddp.py"]}}) == (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/ddp.py"], {})
    monkeypatch.setattr(ttt, "_tune", lambda bench, tmp, flags: (fake, 0.0))
    monkeypatch.setattr(ttt, "TARGET", 0.5)
    monkeypatch.setattr(ttt, "MODEL_FLAGS", ("--model", "cnn", "--dataset", "digits"))
    monkeypatch.setattr(ttt, "base_env", lambda: {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})

    class InProcessBench(harness.Bench):
        def child(self, fn, *, timeout_s=600, **kwargs):
            return fn(**kwargs)

    (tmp_path / "logs").mkdir()
    bench = InProcessBench(suite="cpu", quick=True, threads=1, log_dir=tmp_path / "logs", repeats_override=1,
                           entry="time_to_target")
    outcome = ttt.time_to_target(bench)
    runs = outcome.raw["runs"]
    assert list(runs) == ["naive", "defaults", "tuned"]
    for name, (run,) in runs.items():
        accs = [acc for _, acc in run["curve"]]
        assert run["reached"] and run["stop_reason"].startswith("target reached"), (name, run)
        assert accs[-1] >= 0.5 and all(acc < 0.5 for acc in accs[:-1]), (name, accs)
        assert run["time_to_target_s"] == run["curve"][-1][0] < run["exit_s"]
    ratios = [r for r in outcome.rows if r.kind == "ratio"]
    assert [r.variant for r in ratios] == [ttt.LABELS["defaults"], ttt.LABELS["tuned"]]
    for r, name in zip(ratios, ("defaults", "tuned")):
        assert r.values == pytest.approx([runs["naive"][0]["time_to_target_s"] / runs[name][0]["time_to_target_s"]])
    assert ratios[1].goal == Goal(">=", 3.0) and ratios[0].goal is None
    assert any("layout kept 1 rank x 1 thread (2.50x, noise 10%); compile skipped (too short)" in note
               for note in outcome.notes)
    assert (tmp_path / "time_to_target.png").stat().st_size > 0


def test_interleave_alternates_and_drops_warmup():
    calls = []

    def measure(name):
        calls.append(name)
        return len(calls)

    result = harness.interleave({"a": lambda: measure("a"), "b": lambda: measure("b")}, repeats=2, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert result == {"a": [3, 5], "b": [4, 6]}


def _allocate_child(nbytes: int) -> dict:
    def touch(n):
        return torch.ones(n // 4).sum().item()  # ones() writes every page, so all of it is resident
    touch(4096)  # warm-up: the first call maps kernels' code pages, as the benchmark's warm-up passes do
    _, grown = harness.peak_rss_delta(lambda: touch(nbytes))
    _, idle = harness.peak_rss_delta(lambda: None)
    return {"grown": grown, "idle": idle}


def _failing_child() -> None:
    raise ValueError("no such thing")


def test_fresh_process_sees_a_known_allocation(tmp_path):
    result = fresh_process(_allocate_child, {"nbytes": 40 * 2 ** 20}, log_path=tmp_path / "log", timeout_s=120,
                           threads=1)
    assert 39 * 2 ** 20 <= result["grown"] <= 44 * 2 ** 20, result
    assert result["idle"] < 2 ** 20, result
    with pytest.raises(ChildFailed, match="ValueError: no such thing"):
        fresh_process(_failing_child, {}, log_path=tmp_path / "log", timeout_s=120, threads=1)
    assert "Traceback" in (tmp_path / "log").read_text()


# ---------------------------------------------------------------------- FLOPs and MFU (CPU)
def test_counted_flops_equal_the_closed_form():
    from manual_train.models import GPT

    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    counts = []
    for batch in (2, 4):
        x = torch.randint(64, (batch, 16))
        counts.append(gpu.count_step_flops(model, x, torch.randint(64, (batch, 16))))
        assert counts[-1] == gpu.gpt_flops_per_step(model, batch, 16)
    assert counts[1] == 2 * counts[0]
    # the attention term is part of the count: the count without it is off by exactly 12*L*d*T^2*B
    assert counts[0] - 6 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 32 \
        == 12 * 2 * 32 * 16 * 32
    assert all(p.grad is None for p in model.parameters())
    assert gpu.mfu(3e12, 0.01, 6e14) == pytest.approx(0.5)


# ---------------------------------------------------------------------- the GPU entries' code, walked on the CPU
@pytest.fixture
def one_thread():
    """Tiny ops with 2 intra-op threads on a busy 2-core machine mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gpu_entry_code_runs_on_cpu(one_thread):
    cpu = "cpu"
    result = gpu._precision_child("gpt", layouts=("contiguous",), precisions=gpu.PRECISIONS, batch_size=2,
                                  size=TINY_GPT, image_side=0, warmup=1, steps=1, rounds=1, device=cpu)
    assert set(result["step_s"]) == {f"{p}/contiguous" for p in gpu.PRECISIONS}
    assert all(t[0] > 0 for t in result["step_s"].values()) and result["peak_bytes"] == {}
    rows = gpu._precision_rows("precision", "gpt", result, ("contiguous",), hopper=True, what="tiny")
    assert [r.goal is not None for r in rows if r.metric.startswith("step time")] == [False, True, False, False]

    image = gpu._precision_child("resnet18", layouts=("contiguous", "channels_last"), precisions=("32-true",),
                                 batch_size=2, size="quick", image_side=32, warmup=1, steps=1, rounds=1, device=cpu)
    assert set(image["step_s"]) == {"32-true/contiguous", "32-true/channels_last"}

    syncs = gpu._syncs_per_step_child(steps=2, log_every=2, device=cpu)
    assert set(syncs) == set(gpu.SYNC_VARIANTS) and syncs["ours"]["log_steps"] == [1]

    cudnn = gpu._cudnn_child(benchmark=True, model_name="resnet18", batch_size=2, precision="32-true", warmup=1,
                             steps=1, rounds=2, image_side=32, device=cpu)
    assert len(cudnn["step_s"]) == 2 and cudnn["warmup_s"] > 0

    mfu = gpu._gpt_child(TINY_GPT, batch_size=2, warmup=1, steps=1, rounds=1, compile_model=False, device=cpu,
                         peak_n=64, peak_warmup_s=0.01)
    assert mfu["flops_counted"] == mfu["flops_formula"] > 0 and mfu["peak_flops_per_s"] > 0
    assert len(mfu["step_s"]["eager"]) == 1


class ShrunkBench(harness.Bench):
    """Runs an entry's children in this process on the CPU at toy sizes, to check how entries build rows.

    The children that only mean something on CUDA (copies from pinned memory, sync counts, compilation)
    return results of the shape their CUDA runs return, with made-up numbers: what is checked here is the
    entries' arithmetic and bookkeeping, not a measurement.
    """

    def child(self, fn, *, timeout_s=600, **kwargs):
        if fn is gpu._copies_child:
            readings = {"total_s": [0.2, 0.3], "host_s": [0.1, 0.2]}
            return {"bytes": 10 ** 9, "pageable": readings, "pinned_non_blocking": readings,
                    "pageable_non_blocking": readings}
        if fn is gpu._syncs_per_step_child:
            return {v: {"syncs": [0, 1, 0, 1], "log_steps": [1, 3]} for v in gpu.SYNC_VARIANTS}
        if fn is gpu._loop_syncs_child:
            return {"short_steps": 10, "long_steps": 40, "syncs": {10: 7, 40: 7}}
        toy = {"batch_size": 2, "image_side": 16, "size": TINY_GPT, "steps": 1, "rounds": 1, "warmup": 1,
               "peak_n": 64, "peak_warmup_s": 0.01, "compile_model": False,
               "model_name": "resnet18"}  # 16-bit convs are slow on CPUs
        accepted = inspect.signature(fn).parameters
        kwargs.update({k: v for k, v in toy.items() if k in accepted and kwargs.get(k) != "gpt"})
        if fn is gpu._precision_child and kwargs["model_name"] != "gpt":
            # 16-bit convolutions take ~1 s a step on this CPU: time 32-true only and reuse it for the others
            # (test_gpu_entry_code_runs_on_cpu runs every precision, on the GPT)
            result = fn(**{**kwargs, "precisions": ("32-true",)}, device="cpu")
            result["step_s"] = {f"{p}/{layout}": result["step_s"][f"32-true/{layout}"]
                                for p in kwargs["precisions"] for layout in kwargs["layouts"]}
            return result
        result = fn(**kwargs, device="cpu")
        if fn is gpu._gpt_child:  # compiling needs a GPU here: reuse the eager numbers for the compiled side
            result["step_s"]["compiled"], result["compile_s"] = result["step_s"]["eager"], 0.0
        return result


def test_gpu_entries_build_finite_rows_on_cpu(tmp_path, one_thread):
    bench = ShrunkBench(suite="gpu", quick=True, threads=None, log_dir=tmp_path,
                        device_info={"available": True, "capability": "9.0", "name": "NVIDIA H200"})
    for name, (entry, _) in gpu.ENTRIES.items():
        bench.entry = name
        outcome = entry(bench)
        assert outcome.rows, name
        for row in outcome.rows:
            assert row.entry == name and row.values and all(math.isfinite(v) for v in row.values), row
        if name == "gpt_compile_mfu":  # MFU against both peaks; the goal on the datasheet's
            mfu_rows = [r for r in outcome.rows if r.metric.startswith("MFU")]
            assert [(r.baseline, r.goal is not None) for r in mfu_rows] == \
                [("datasheet bf16 dense peak (989 TFLOP/s)", True), ("bf16 matmul peak (measured)", False)] * 2
            times, flops = outcome.raw["step_s"]["eager"], outcome.raw["flops_counted"]
            assert mfu_rows[0].values == pytest.approx([100 * flops / t / 989e12 for t in times])
            assert any("NVIDIA H200 (SXM) datasheet" in note for note in outcome.notes)


def test_matmul_peak_warms_up_then_times_blocks_of_matmuls():
    peak = gpu.matmul_peak_flops(torch.device("cpu"), n=32, warmup_s=0.05, matmuls_per_block=4, blocks=3)
    assert peak["warmup_s"] >= 0.05 and peak["warmup_matmuls"] >= 8
    assert len(peak["block_s"]) == 3 and peak["flops_per_s"] == max(2 * 32 ** 3 / t for t in peak["block_s"])
    assert peak["flops_per_s"] >= peak["median_flops_per_s"] > 0


def test_datasheet_peaks_match_device_names():
    assert gpu.datasheet_bf16_peak("NVIDIA H200")[0] == 989e12
    assert gpu.datasheet_bf16_peak("NVIDIA H200 NVL")[0] == 835e12  # the more specific name wins
    assert gpu.datasheet_bf16_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert gpu.datasheet_bf16_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert gpu.datasheet_bf16_peak("NVIDIA GeForce RTX 4090") is None


# ---------------------------------------------------------------------- on a GPU (scripts/gpu_check.sh)
def needs_cuda(test):
    """conftest.cuda_devices(1) as one decorator: marked gpu, skipped without a CUDA device."""
    for mark in cuda_devices(1):
        test = mark(test)
    return test


@needs_cuda
def test_logging_idioms_sync_counts_on_cuda():
    result = gpu._syncs_per_step_child(steps=6, log_every=3)
    ours = result["ours"]
    for i, count in enumerate(ours["syncs"]):
        assert (count >= 1) if i in ours["log_steps"] else (count == 0), (i, ours)
    assert all(c >= 1 for c in result["item"]["syncs"])
    assert all(c == 0 for c in result["append"]["syncs"])


@needs_cuda
@pytest.mark.parametrize("precision, per_step", [("32-true", 0), ("16-mixed", 2), ("16-o2", 1)])
def test_real_loop_syncs_per_non_log_step_on_cuda(precision, per_step):
    """32-true: none. 16-mixed (loops/single.py): GradScaler.step's found_inf.item() and Run.stepped's get_scale()
    (which tells whether the step was skipped). 16-o2 (loops/apex_o2.py): the overflow check's .item(); its
    scale lives on the host, so Run.stepped's get_scale() costs nothing."""
    r = gpu._loop_syncs_child(short_steps=4, long_steps=12, precision=precision)
    assert r["syncs"][12] - r["syncs"][4] == per_step * 8, r


@needs_cuda
def test_counted_flops_on_cuda_under_bf16_autocast():
    from manual_train.models import GPT

    model = GPT(**TINY_GPT).cuda()
    x, y = torch.randint(64, (4, 16), device="cuda"), torch.randint(64, (4, 16), device="cuda")
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    assert gpu.count_step_flops(model, x, y, autocast) == gpu.gpt_flops_per_step(model, 4, 16)
