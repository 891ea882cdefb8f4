"""What a user reaches for every day (docs/everyday.md): the model summary, dropout and an exact mid-epoch resume
with it, clipping by value, anomaly detection, --max-time, the smoke-test limits and --fast-dev-run, validation
and checkpoints every N steps, the profiler window. Each test has a known-wrong variant that fails it."""
from __future__ import annotations

import csv
import json
import re
from contextlib import contextmanager

import pytest
import torch
from conftest import PARITY_TOL_64, load_model_state, make_cfg, max_param_diff, run_script, torchrun
from torch.utils.data import DataLoader

from manual_train import data
from manual_train import run as run_module
from manual_train.cli import run
from manual_train.config import limited_batches
from manual_train.evaluation import evaluate
from manual_train.loops import single
from manual_train.metrics import model_summary
from manual_train.models import GPT, DataInfo, build_model, loss_fn
from manual_train.runtime import TrainingDiverged


def rows(run_dir, split=None):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if split is None or r["split"] == split]


def checkpoint(run_dir, name="last.pt"):
    return torch.load(run_dir / name, map_location="cpu", weights_only=True)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bitwise equal: {different}"


# ---------------------------------------------------------------------- 5. the model summary
def test_model_summary_counts_tied_weights_once():
    gpt = GPT(vocab=50, block_size=8, n_layer=2, n_head=2, n_embd=16)  # head.weight is tok.weight
    total = sum(p.numel() for p in gpt.parameters())
    lines = model_summary(gpt, 1).splitlines()
    counts = [int(line.split()[2].replace(",", "")) for line in lines[1:-1]]
    assert [line.split()[0] for line in lines[1:-1]] == ["tok", "pos", "drop", "blocks", "ln_f", "head"]
    assert sum(counts) == total and f"{total:,} total parameters" in lines[-1]
    # known-wrong: each module's own parameters() counts the tied matrix in tok and again in head
    naive = sum(sum(p.numel() for p in m.parameters()) for m in gpt.children())
    assert naive == total + 50 * 16


def test_model_summary_depth_and_trainable_counts():
    model = build_model("cnn", DataInfo("digits", (1, 8, 8), 10))
    model.features.requires_grad_(False)
    text = model_summary(model, 2)
    assert "features.0" in text and "head.2" in text  # depth 2: the layers inside each Sequential
    frozen = sum(p.numel() for p in model.features.parameters())
    assert f"{frozen:,} non-trainable" in text.splitlines()[-1]
    assert model_summary(model, 1).count("\n") == 3  # header, features, head, totals


def test_the_banner_shows_the_summary(tmp_path, capsys):
    single.train(make_cfg(tmp_path, model="mlp", max_steps=1, limit_val_batches="1"))
    out = capsys.readouterr().out
    assert re.search(r"\n  net\s+Sequential\s+26,122\s+26,122\n", out)
    assert "26,122 trainable, 0 non-trainable, 26,122 total parameters" in out


# ---------------------------------------------------------------------- 7. dropout, and resume with it
def test_dropout_zero_changes_nothing_and_draws_nothing(tmp_path):
    """--dropout 0 (the default) keeps every parity test's computation: no random numbers drawn, same weights."""
    torch.manual_seed(0)
    model = build_model("mlp", DataInfo("digits", (1, 8, 8), 10), dropout=0.0).train()
    x = torch.randn(4, 1, 8, 8)
    state = torch.get_rng_state()
    assert torch.equal(model(x), model.eval()(x))
    assert torch.equal(torch.get_rng_state(), state)
    dropped = build_model("mlp", DataInfo("digits", (1, 8, 8), 10), dropout=0.5).train()
    dropped.load_state_dict(model.state_dict())  # the same keys: dropout holds no state
    assert not torch.equal(dropped(x), model(x))  # known-wrong check: dropout > 0 does change the output


RESUME = dict(model="mlp", dropout=0.2, num_workers=2, epochs=2, batch_size=32, log_every=5,
              checkpoint_every_steps=10, val_every_steps=15, precision="64-true")


class Crash(Exception):
    pass


def _flags(**cfg) -> list[str]:
    argv = []
    for k, v in cfg.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@contextmanager
def crashes_at(loop, call: int):
    """The body must raise Crash: loop.loss_fn raises it at training's call number `call` (from 1), in the middle of
    that optimizer step (accumulate 1), after whatever the run saved before; loss_fn is restored afterwards."""
    real_loss, calls = loop.loss_fn, []

    def crash(logits, y, **kw):
        calls.append(1) if not kw else None  # training's calls (evaluation's pass reduction="sum")
        if len(calls) == call:
            raise Crash
        return real_loss(logits, y, **kw)

    loop.loss_fn = crash
    try:
        with pytest.raises(Crash):
            yield
    finally:
        loop.loss_fn = real_loss


def test_mid_epoch_resume_with_dropout_and_workers_is_bitwise(tmp_path):
    """Crashed in step 26, after the mid-epoch checkpoint of step 20, resumed: the final weights, optimizer state and
    metrics are the uninterrupted run's, bit for bit, with dropout drawing from the restored RNG and two loader
    workers. All three runs in this process: bit for bit is a claim about one code path in one kind of process."""
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), **RESUME))
    with crashes_at(single, 26):
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), **RESUME))
    killed = checkpoint(tmp_path / "B")
    assert (killed["step"], killed["epoch"], killed["progress"]["micro_steps_done"]) == (20, 0, 20)  # mid-epoch
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), resume="auto", **RESUME))
    a, b = checkpoint(tmp_path / "A"), checkpoint(tmp_path / "B")
    assert_bitwise(a["model"], b["model"])
    assert_bitwise({i: s["momentum_buffer"] for i, s in a["optimizer"]["state"].items()},
                   {i: s["momentum_buffer"] for i, s in b["optimizer"]["state"].items()})
    timing = ("samples_per_s", "time_s")
    strip = [{k: v for k, v in r.items() if k not in timing} for r in rows(tmp_path / "A")]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in rows(tmp_path / "B")]


class GlobalSeeded(DataLoader):
    """The known-wrong variant: a plain DataLoader, which draws its workers' base seed from the global RNG."""


def test_a_loader_seeded_from_the_global_rng_breaks_the_mid_epoch_resume(tmp_path, monkeypatch):
    """The same kill-and-resume, in this process (a raised exception instead of SIGKILL), with data.SeededLoader
    replaced by a plain DataLoader: the resumed run draws one more base seed than the uninterrupted one, and every
    dropout mask after the resume differs."""
    monkeypatch.setattr(data, "SeededLoader", GlobalSeeded)
    flags = dict(RESUME, num_workers=0)
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), **flags))
    with crashes_at(single, 26):
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), **flags))
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), resume="auto", **flags))
    assert max_param_diff(checkpoint(tmp_path / "A")["model"], checkpoint(tmp_path / "B")["model"]) > 1e-6


def test_ddp_mid_epoch_resume_with_dropout_is_bitwise(tmp_path):
    """Under torchrun (2 ranks, each its own dropout stream and workers): killed on rank 1 after a mid-epoch
    checkpoint, resumed; the final weights are the uninterrupted run's, bit for bit."""
    flags = ["--no-progress", *_flags(model="mlp", dropout=0.2, num_workers=1, batch_size=16, max_steps=30,
                                      checkpoint_every_steps=10, precision="64-true", log_every=5)]
    proc = run_script("ddp", "--out-dir", str(tmp_path / "A"), *flags, launcher=torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_script("tests/faulty_ddp", "--fail-at-step", "15", "--fail-rank", "1", "--fail-mode", "kill",
                      "--out-dir", str(tmp_path / "B"), *flags, launcher=torchrun(2))
    assert proc.returncode != 0 and checkpoint(tmp_path / "B")["step"] == 10
    proc = run_script("ddp", "--out-dir", str(tmp_path / "B"), "--resume", "auto", *flags, launcher=torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 10, in epoch 1" in proc.stdout  # a resume, not a rerun from scratch (which ends bitwise equal too)
    assert_bitwise(load_model_state(tmp_path / "A"), load_model_state(tmp_path / "B"))


# ---------------------------------------------------------------------- 6. clip by value, anomaly, max-time
def _first_step_by_hand(tmp_path, clip):
    """One SGD step of the 64-true mlp on the first batch, written out: w - lr * clamp(g, -v, v) (momentum's
    buffer is the gradient itself on the first step)."""
    cfg = make_cfg(tmp_path, model="mlp", precision="64-true")
    train_ds, _, info = data.build_datasets(cfg)
    sampler = data.train_sampler(train_ds, cfg.seed)
    sampler.set_epoch(0)
    x, y = next(iter(data.build_loader(train_ds, cfg, torch.device("cpu"), batch_size=32, sampler=sampler)))
    torch.manual_seed(cfg.seed)
    model = build_model("mlp", info).double()
    loss_fn(model(x.double()), y).backward()
    return {k: (p - 0.05 * clip(p.grad)).detach() for k, p in model.named_parameters()}


def test_grad_clip_value_clamps_every_element(tmp_path):
    v = 1e-3
    single.train(make_cfg(tmp_path, model="mlp", precision="64-true", max_steps=1, schedule="constant",
                          grad_clip_value=v, limit_val_batches="1"))
    trained = load_model_state(tmp_path / "run")
    expected = _first_step_by_hand(tmp_path / "by-hand", lambda g: g.clamp(-v, v))
    assert max_param_diff(trained, expected) < PARITY_TOL_64
    unclipped = _first_step_by_hand(tmp_path / "by-hand", lambda g: g)  # known-wrong: no clipping
    assert max_param_diff(trained, unclipped) > 1e-4
    by_norm = _first_step_by_hand(tmp_path / "by-hand", lambda g: g * min(1.0, v / g.norm().item()))
    assert max_param_diff(trained, by_norm) > 1e-6  # known-wrong: clipping the norm is another rule


def test_clip_by_norm_and_by_value_together_is_one_line(tmp_path, capsys):
    status = run(single.train, script="single", argv=["--grad-clip", "1", "--grad-clip-value", "1",
                                                      "--out-dir", str(tmp_path / "r")])
    assert status == 2
    assert capsys.readouterr().err.startswith("error: --grad-clip-value: clips by value; --grad-clip clips by norm")


def _nan_in_backward(logits, y, **kw):
    """A finite loss whose backward makes NaN: sqrt's backward at u = 0 divides the incoming 0 by 2 * sqrt(0)."""
    return loss_fn(logits, y, **kw) + 0 * (logits.sum() * 0).sqrt()


def test_detect_anomaly_names_the_backward_op(tmp_path, monkeypatch):
    monkeypatch.setattr(single, "loss_fn", _nan_in_backward)
    try:
        with pytest.raises(RuntimeError, match="SqrtBackward0"):
            single.train(make_cfg(tmp_path, model="mlp", max_steps=20, log_every=1, detect_anomaly=True))
    finally:
        torch.autograd.set_detect_anomaly(False)
    # known-wrong (without it): nothing names the op; the NaN weights surface later, as a NaN loss
    with pytest.raises(TrainingDiverged):
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "plain"), model="mlp", max_steps=20, log_every=1))
    assert not torch.is_anomaly_enabled()


class FakeClock:
    """time.perf_counter for run.py: one second per call, so --max-time stops at a known step (no timing)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def test_max_time_stops_at_a_step_boundary_and_resumes_exactly(tmp_path, monkeypatch):
    flags = dict(model="mlp", dropout=0.2, epochs=2, log_every=5, precision="64-true")
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), **flags))
    monkeypatch.setattr(run_module, "time", FakeClock())
    summary = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), max_time="00:00:01:00", **flags))
    stopped = checkpoint(tmp_path / "B")
    assert 0 < summary["optimizer_steps"] < 94 and stopped["step"] == summary["optimizer_steps"]
    assert summary["stop_reason"].startswith("--max-time 00:00:01:00 reached after step")
    assert not summary["stopped_early"]
    assert rows(tmp_path / "B", "val")[-1]["step"] == str(stopped["step"])  # validated where it stopped
    monkeypatch.undo()
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), resume="auto", **flags))
    assert_bitwise(load_model_state(tmp_path / "A"), load_model_state(tmp_path / "B"))


# ---------------------------------------------------------------------- 3. limits and fast-dev-run
def test_limited_batches_as_lightning_counts_them():
    assert limited_batches(None, 47, "--x") == 47
    assert limited_batches(5, 47, "--x") == 5 and limited_batches(500, 47, "--x") == 47
    assert limited_batches(0.5, 47, "--x") == 23  # int(0.5 * 47), as Lightning (not round: 24)
    assert limited_batches(1.0, 47, "--x") == 47


def test_limit_train_batches_is_the_epoch_also_for_the_last_window(tmp_path):
    """--limit-train-batches 4 at batch 16 x accumulate 2 trains the 64-true weights of --limit-train-batches 2 at
    batch 32: the limit cuts each epoch's samples, and the windows, steps and schedule follow from them."""
    common = dict(model="mlp", precision="64-true", epochs=2, limit_val_batches="1", log_every=1)
    a = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "a"), batch_size=16, accumulate=2,
                              limit_train_batches="4", **common))
    b = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "b"), batch_size=32, limit_train_batches="2",
                              **common))
    assert a["optimizer_steps"] == b["optimizer_steps"] == 4 and a["samples_seen"] == b["samples_seen"] == 128
    assert max_param_diff(load_model_state(tmp_path / "a"), load_model_state(tmp_path / "b")) < PARITY_TOL_64
    c = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "c"), batch_size=16, accumulate=2,
                              limit_train_batches="5", **common))
    assert c["optimizer_steps"] == 6 and c["samples_seen"] == 160  # windows of 2, 2, 1 micro-batches per epoch


def test_limit_val_batches_evaluates_exactly_the_first_batches(tmp_path):
    summary = single.train(make_cfg(tmp_path, model="mlp", max_steps=3, eval_batch_size=50,
                                    limit_val_batches="2"))
    cfg = make_cfg(tmp_path, out_dir=str(tmp_path / "x"), model="mlp")
    _, val_ds, info = data.build_datasets(cfg)
    model = build_model("mlp", info)
    model.load_state_dict(load_model_state(tmp_path / "run"))
    first_100 = torch.utils.data.Subset(val_ds, range(100))
    loss, correct, count = evaluate(model, DataLoader(first_100, batch_size=50), torch.device("cpu"))
    assert count.item() == 100
    assert summary["final_val_loss"] == pytest.approx((loss / count).item(), rel=1e-6)
    everything = evaluate(model, DataLoader(val_ds, batch_size=50), torch.device("cpu"))
    assert summary["final_val_loss"] != pytest.approx((everything[0] / everything[2]).item(), rel=1e-6)


def test_fast_dev_run_trains_one_step_and_keeps_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    status = run(single.train, script="single", argv=["--fast-dev-run", "--model", "mlp", "--out-dir", str(out),
                                                      "--no-progress"])
    assert status == 0
    text = capsys.readouterr().out
    assert "after 1 steps" in text and "no outputs kept" in text
    assert not out.exists()
    # the control: the same run without --fast-dev-run writes its outputs
    assert run(single.train, script="single", argv=["--model", "mlp", "--max-steps", "1", "--out-dir", str(out),
                                                    "--no-progress"]) == 0
    assert (out / "last.pt").exists()


# ---------------------------------------------------------------------- 2. validation and checkpoints every N steps
def test_val_and_checkpoint_every_n_steps_inside_the_epoch(tmp_path, monkeypatch):
    written = []
    real_save = run_module.save_checkpoint
    monkeypatch.setattr(run_module, "save_checkpoint",
                        lambda state, path: (written.append((path.name, state["step"])), real_save(state, path)))
    summary = single.train(make_cfg(tmp_path, model="mlp", epochs=2, val_every_steps=20, checkpoint_every_steps=7,
                                    log_every=5))
    val_steps = [int(r["step"]) for r in rows(tmp_path / "run", "val")]
    assert val_steps == [20, 40, 47, 60, 80, 94] and summary["optimizer_steps"] == 94
    # best.pt is written at the validation that improved, with the weights it evaluated (not at the next save: 21)
    best_steps = [step for name, step in written if name == "best.pt"]
    assert 20 in best_steps and set(best_steps) <= set(val_steps)
    assert {step for name, step in written if name == "last.pt"} >= {7, 14, 20, 21, 28, 47, 49, 94}


def test_a_checkpoint_every_n_steps_is_written_mid_epoch(tmp_path, monkeypatch):
    written = []
    real_save = run_module.save_checkpoint
    monkeypatch.setattr(run_module, "save_checkpoint",
                        lambda state, path: (written.append((path.name, state["step"],
                                                             state["progress"]["micro_steps_done"])),
                                             real_save(state, path)))
    single.train(make_cfg(tmp_path, model="mlp", max_steps=30, checkpoint_every_steps=12, eval_every=5))
    assert [w for w in written if w[0] == "last.pt"] == [("last.pt", 12, 12), ("last.pt", 24, 24),
                                                         ("last.pt", 30, 30)]


# ---------------------------------------------------------------------- 4. the profiler
def test_profile_records_the_window_of_steps(tmp_path):
    single.train(make_cfg(tmp_path, model="mlp", max_steps=8, profile_steps="3:5", limit_val_batches="1"))
    folder = tmp_path / "run" / "profile"
    trace = json.loads((folder / "trace-rank0.json").read_text())
    steps = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]  # the profiler's own count: the 4th and 5th steps
    table = (folder / "ops-rank0.txt").read_text()
    assert "aten::addmm" in table and "Self CPU" in table


def test_a_resumed_run_profiles_the_same_steps(tmp_path):
    single.train(make_cfg(tmp_path, model="mlp", max_steps=3, schedule="constant", limit_val_batches="1"))
    single.train(make_cfg(tmp_path, model="mlp", max_steps=8, schedule="constant", limit_val_batches="1",
                          resume="auto", profile_steps="5:7"))
    trace = json.loads((tmp_path / "run" / "profile" / "trace-rank0.json").read_text())
    steps = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # steps 6 and 7: the 3rd and 4th after step 3
