"""Checkpoints: exact resume (weights, metrics, RNG), atomic writes, bad files, incompatible configs,
and a diverging loss that stops the run while keeping the last good checkpoint."""
from __future__ import annotations

import csv
import io
import pickle

import pytest
import torch
from conftest import assert_same_path_bitwise, make_cfg, run_script

from manual_train import checkpoint as ckpt_mod
from manual_train import models
from manual_train import run as run_module
from manual_train.cli import run
from manual_train.loops import single
from manual_train.runtime import TrainingDiverged

TIMING = ("samples_per_s", "time_s")


class Crash(Exception):
    pass


def rows_without_timing(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def recording_loss_fn(draws, crash_after=None):
    """loss_fn that also draws from torch's global RNG (as dropout or augmentation would) and records it,
    and optionally crashes the run after a number of micro-steps (a killed process, as far as files go)."""

    def loss(logits, y, **kw):
        if kw:  # evaluation's (reduction="sum"): no draw
            return models.loss_fn(logits, y, **kw)
        if crash_after is not None and len(draws) == crash_after:
            raise Crash
        draws.append(torch.rand(()).item())
        return models.loss_fn(logits, y)

    return loss


# Bitwise in any precision: the resumed run repeats the uninterrupted run's computations. 64-true also proves
# that float64 weights come back as they were saved (loaded after the upcast, never rounded through fp32). The mlp:
# what is resumed (weights, momentum, RNG, sampler, metrics) does not depend on the model; 5 s instead of the cnn's 55.
@pytest.mark.parametrize("workers, precision", [(0, "32-true"), (2, "32-true"), (0, "64-true")])
def test_interrupted_then_resumed_equals_uninterrupted_bitwise(tmp_path, monkeypatch, workers, precision):
    flags = dict(model="mlp", epochs=3, log_every=5, num_workers=workers, precision=precision)
    draws_a = []
    monkeypatch.setattr(single, "loss_fn", recording_loss_fn(draws_a))
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), **flags))

    # B crashes in epoch 2 (micro-step 60 of 47 per epoch): its last.pt is from the end of epoch 1
    draws_b = []
    monkeypatch.setattr(single, "loss_fn", recording_loss_fn(draws_b, crash_after=60))
    with pytest.raises(Crash):
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), **flags))
    assert torch.load(tmp_path / "B" / "last.pt", weights_only=True)["step"] == 47
    assert max(int(r["step"]) for r in rows_without_timing(tmp_path / "B" / "metrics.csv")) == 60

    # resume into the same folder, as a restarted job does
    draws_c = []
    monkeypatch.setattr(single, "loss_fn", recording_loss_fn(draws_c))
    summary = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), resume="auto", **flags))
    assert summary["optimizer_steps"] == 3 * 47 and summary["samples_seen"] == 3 * 1500

    a = torch.load(tmp_path / "A" / "last.pt", weights_only=True)
    c = torch.load(tmp_path / "B" / "last.pt", weights_only=True)
    assert_same_path_bitwise(a["model"], c["model"], "crashed + resumed vs uninterrupted")
    assert {v.dtype for v in c["model"].values()} == {torch.float64 if precision == "64-true" else torch.float32}
    assert all(torch.equal(a["optimizer"]["state"][i]["momentum_buffer"], c["optimizer"]["state"][i]["momentum_buffer"])
               for i in a["optimizer"]["state"])
    # metrics.csv: the rows the crash logged after the checkpoint were dropped and recomputed identically
    assert rows_without_timing(tmp_path / "A" / "metrics.csv") == rows_without_timing(tmp_path / "B" / "metrics.csv")
    # the RNG stream continues where it was: draws after the resume point are the uninterrupted run's
    assert draws_c == draws_a[47:]


# The same proof on a short set in ~2 s (make mutants runs it against each resume mutant, tests/mutants/resume.py):
# 88 samples of 16 (6 steps an epoch, the last partial), dropout drawing from the RNG, SGD's momentum, the cosine
# schedule, and a checkpoint every 4 steps, so that a run that dies in step 5 resumes mid-epoch.
SHORT = dict(model="mlp", dataset="synthetic", synthetic_size=88, synthetic_shape="1,8,8", synthetic_classes=4,
             dropout=0.2, epochs=2, batch_size=16, checkpoint_every_steps=4, log_every=1, precision="64-true")


def test_a_mid_epoch_resume_on_a_short_set_is_bitwise(tmp_path, monkeypatch):
    """Killed in step 5, resumed from step 4's last.pt: the uninterrupted run's weights, momentum, schedule and
    metrics, bit for bit. A resume that drops the RNG streams, the optimizer's or the scheduler's state, or the
    position in the epoch does not get there."""
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), **SHORT))
    calls = []

    def dies_in_step_5(logits, y, **kw):  # draws nothing: the run is the uninterrupted one up to the crash
        calls.append(1) if not kw else None
        if len(calls) == 5:
            raise Crash
        return models.loss_fn(logits, y)

    monkeypatch.setattr(single, "loss_fn", dies_in_step_5)
    with pytest.raises(Crash):
        single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), **SHORT))
    saved = torch.load(tmp_path / "B" / "last.pt", weights_only=True)
    assert (saved["step"], saved["epoch"], saved["progress"]["micro_steps_done"]) == (4, 0, 4)  # mid-epoch
    monkeypatch.setattr(single, "loss_fn", models.loss_fn)
    summary = single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "B"), resume="auto", **SHORT))
    assert summary["optimizer_steps"] == 12 and summary["samples_seen"] == 2 * 88
    a = torch.load(tmp_path / "A" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "B" / "last.pt", weights_only=True)
    assert_same_path_bitwise(a["model"], b["model"], "killed in step 5 + resumed vs uninterrupted")
    assert_same_path_bitwise({str(i): s["momentum_buffer"] for i, s in a["optimizer"]["state"].items()},
                             {str(i): s["momentum_buffer"] for i, s in b["optimizer"]["state"].items()}, "momentum")
    assert a["scheduler"] == b["scheduler"]
    assert rows_without_timing(tmp_path / "A" / "metrics.csv") == rows_without_timing(tmp_path / "B" / "metrics.csv")


def test_without_rng_state_the_stream_would_differ(tmp_path, monkeypatch):
    """Shows the RNG check above can fail: a resume that skips restore_rng draws other numbers."""
    draws_a = []
    monkeypatch.setattr(single, "loss_fn", recording_loss_fn(draws_a))
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "A"), epochs=2))
    draws_c = []
    monkeypatch.setattr(single, "loss_fn", recording_loss_fn(draws_c))
    monkeypatch.setattr(run_module, "restore_rng", lambda state: None)  # Lightning-style: no RNG in checkpoints
    ckpt = tmp_path / "A" / "mid.pt"
    state = torch.load(tmp_path / "A" / "last.pt", weights_only=True)
    state["epoch"], state["step"] = 1, 47  # pretend it is the epoch-1 checkpoint (weights don't matter here)
    ckpt_mod.save_checkpoint(state, ckpt)
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "C"), epochs=2, resume=str(ckpt)))
    assert draws_c != draws_a[47:]


def test_a_crash_while_saving_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    good = {"model": {"w": torch.ones(3)}, "step": 1}
    ckpt_mod.save_checkpoint(good, path)

    def dies_midway(obj, f):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the temp file ...
        raise OSError("disk full")  # ... then the write fails

    monkeypatch.setattr(ckpt_mod.torch, "save", dies_midway)
    with pytest.raises(OSError):
        ckpt_mod.save_checkpoint({"model": {"w": torch.zeros(3)}, "step": 2}, path)
    monkeypatch.undo()
    back = torch.load(path, weights_only=True)
    assert back["step"] == 1 and torch.equal(back["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"], "the temp file is cleaned up"


class Foreign:  # a pickled object weights_only must refuse to construct
    def __reduce__(self):
        return (print, ("this would run on load",))


def bad_files(tmp_path):
    good = tmp_path / "good.pt"
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "g"), max_steps=3))
    good = tmp_path / "g" / "last.pt"
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:2000])
    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(range(256)) * 10)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, foreign)  # a valid torch file, not ours
    code = tmp_path / "code.pt"
    buf = io.BytesIO()
    pickle.dump({"model": Foreign()}, buf)
    code.write_bytes(buf.getvalue())
    return {"truncated": truncated, "noise": noise, "foreign": foreign, "code": code}


def test_corrupt_or_foreign_checkpoints_are_one_line_errors(tmp_path, capsys):
    for name, path in bad_files(tmp_path).items():
        capsys.readouterr()
        code = run(single.train, script="single", argv=["--resume", str(path), "--out-dir", str(tmp_path / name),
                                                         "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, name
        assert len(err) == 1 and err[0].startswith("error: --resume:"), (name, err)
        assert not (tmp_path / name).exists(), "nothing is created for a rejected checkpoint"


def test_incompatible_checkpoint_names_the_mismatch(tmp_path):
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "cnn"), max_steps=3))
    proc = run_script("single", "--model", "mlp", "--resume", str(tmp_path / "cnn" / "last.pt"),
                      "--out-dir", str(tmp_path / "mlp"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --resume: checkpoint was trained with --model cnn, this run has mlp")


def test_existing_run_folder_is_not_overwritten(tmp_path, capsys):
    single.train(make_cfg(tmp_path, out_dir=str(tmp_path / "r"), max_steps=3))
    before = (tmp_path / "r" / "last.pt").read_bytes()
    assert run(single.train, script="single", argv=["--out-dir", str(tmp_path / "r")]) == 2
    assert "--resume auto" in capsys.readouterr().err
    assert (tmp_path / "r" / "last.pt").read_bytes() == before


def test_a_diverging_lr_stops_with_the_step_named(tmp_path):
    proc = run_script("single", "--model", "mlp", "--lr", "1e8", "--log-every", "1", "--no-progress", "--out-dir", str(tmp_path / "d"))
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "training loss is nan at step" in err[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "d" / "last.pt").exists()  # no checkpoint of NaN weights is ever written


def test_divergence_after_a_checkpoint_keeps_it(tmp_path, monkeypatch):
    def nan_from_step_60(logits, y, calls=[], **kw):
        calls.append(1) if not kw else None
        loss = models.loss_fn(logits, y, **kw)
        return loss * float("nan") if len(calls) > 60 else loss

    monkeypatch.setattr(single, "loss_fn", nan_from_step_60)
    with pytest.raises(TrainingDiverged, match="at step 61.*last good checkpoint"):
        single.train(make_cfg(tmp_path, model="mlp", epochs=3, log_every=1))
    kept = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert kept["step"] == 47 and all(v.isfinite().all() for v in kept["model"].values())


def test_checkpoint_rng_state_restores_every_stream_where_it_was(tmp_path):
    """capture_rng -> torch.save -> torch.load(weights_only=True) -> restore_rng: python's, numpy's (its position in
    the Mersenne state too, not only the keys) and torch's streams continue as if never interrupted."""
    import random

    import numpy as np

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.random(), np.random.rand(7), np.random.randn(1), torch.rand(3)  # mid-stream; numpy holds a cached gaussian
    ckpt_mod.save_checkpoint({"rng": ckpt_mod.capture_rng()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(5).tolist(), np.random.randn(3).tolist(), torch.rand(4))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)  # elsewhere in every stream
    ckpt_mod.restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    got = (random.random(), np.random.rand(5).tolist(), np.random.randn(3).tolist(), torch.rand(4))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_save_checkpoint_into_a_folder_that_is_gone_is_a_storage_error_naming_it(tmp_path):
    """The temporary file was never created: its cleanup must not replace the StorageError with its own error."""
    from manual_train.errors import StorageError

    with pytest.raises(StorageError, match="the folder is gone"):
        ckpt_mod.save_checkpoint({"step": 1}, tmp_path / "gone" / "last.pt")


def test_checkpoint_left_by_a_failed_save_is_read_weights_only(tmp_path):
    """After a failed save the message says what the previous file holds, read with weights_only=True: a file that
    is a pickle of arbitrary objects is reported untouched, and its code never runs."""
    import pathlib

    marker = tmp_path / "the pickle ran"

    class Payload:
        def __reduce__(self):
            return pathlib.Path.touch, (marker,)

    torch.save({"progress": Payload()}, tmp_path / "last.pt")
    assert ckpt_mod.what_is_intact(tmp_path / "last.pt") == "the previous last.pt is untouched"
    assert not marker.exists()
    ckpt_mod.save_checkpoint({"progress": {"micro_steps_done": 0}, "epoch": 3, "step": 12}, tmp_path / "last.pt")
    assert ckpt_mod.what_is_intact(tmp_path / "last.pt") == "the previous last.pt (after epoch 3, step 12) is intact"


def _dcp_folder(tmp_path):
    """A dcp checkpoint as Run writes one, in this process alone (DCP needs no process group for one writer): a
    Linear and its Adam state after one step, the shards by save_sharded, meta.pt beside them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    folder = tmp_path / "step-1.dcp"
    rest, _ = ckpt_mod.save_sharded(model, optimizer, folder)
    ckpt_mod.save_checkpoint(_meta("dcp", rest), folder / ckpt_mod.DCP_META)
    return folder, model, optimizer


def _meta(fmt: str, rest: dict) -> dict:
    """meta.pt: a checkpoint's keys (the tensors' are empty: they are the shards), the format and `rest`."""
    return {**{k: {} for k in ckpt_mod.REQUIRED_KEYS}, "epoch": 0, "world_size": 1, "step": 1, "format": fmt,
            "rest": rest}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended here
def test_checkpoint_dcp_folder_loads_whole_and_each_bad_folder_is_one_line_naming_the_flag(tmp_path):
    import shutil
    from pathlib import Path

    folder, model, optimizer = _dcp_folder(tmp_path)
    full = ckpt_mod.load_dcp(folder, "--checkpoint")
    assert full["step"] == 1 and full["dcp"] == str(folder.resolve())
    assert all(torch.equal(full["model"][k], v) for k, v in model.state_dict().items())
    assert torch.equal(full["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    def refused(folder) -> str:
        with pytest.raises(ckpt_mod.UsageError) as e:
            ckpt_mod.load_dcp(folder, "--checkpoint")
        assert str(e.value).startswith(f"--checkpoint: {folder}"), str(e.value)
        return str(e.value)

    def copy(name):
        return Path(shutil.copytree(folder, tmp_path / name))

    (tmp_path / "empty").mkdir()
    assert "is not a readable DCP checkpoint" in refused(tmp_path / "empty")
    cut = copy("cut")
    shard = next(cut.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert "is missing or has a truncated shard file" in refused(cut)
    no_meta = copy("no-meta")
    (no_meta / ckpt_mod.DCP_META).unlink()
    assert "is not a manual_train dcp checkpoint" in refused(no_meta)
    other = copy("other-format")
    ckpt_mod.save_checkpoint(_meta("a", {}), other / ckpt_mod.DCP_META)
    assert "is not a manual_train dcp checkpoint" in refused(other)
    garbled = copy("garbled")
    shard = next(garbled.glob("*.distcp"))
    shard.write_bytes(bytes(len(shard.read_bytes())))  # the right size, zeros: DCP cannot read its tensors
    assert "its shards cannot be read" in refused(garbled)


def _saved(tmp_path, step=5, world_size=1, progress=None, **flags) -> dict:
    """The keys check_compatible reads, as build_checkpoint writes them, for a run of these flags."""
    import dataclasses

    cfg = make_cfg(tmp_path, **flags)
    return {"config": dataclasses.asdict(cfg), "world_size": world_size, "step": step, "epoch": 0, "early_stopping": {},
            "progress": {"epoch_samples_done": 0, **(progress or {})}}


def test_checkpoint_resume_at_another_world_size_is_allowed_without_dropout_and_refused_with_it(tmp_path):
    """The same global batch of 8 split over 2 ranks (batch 4): allowed; with dropout, each rank's own masks cannot
    be redrawn by 2 ranks: refused, naming both world sizes."""
    ckpt_mod.check_compatible(_saved(tmp_path, batch_size=8), make_cfg(tmp_path, batch_size=4), 8, 10)
    with pytest.raises(ckpt_mod.UsageError) as refused:
        ckpt_mod.check_compatible(_saved(tmp_path, batch_size=8, dropout=0.1),
                                  make_cfg(tmp_path, batch_size=4, dropout=0.1), 8, 10)
    assert str(refused.value).startswith("--resume: the checkpoint was written at world size 1, this run has 2: "
                                         "with --dropout 0.1"), str(refused.value)


def test_checkpoint_limit_train_batches_must_count_the_same_micro_batch_and_the_step_must_be_ahead(tmp_path):
    saved = _saved(tmp_path, batch_size=8, limit_train_batches="3")
    with pytest.raises(ckpt_mod.UsageError) as refused:  # batch 2 x accumulate 2 x 2 ranks: 8, micro-batches of 4
        ckpt_mod.check_compatible(saved, make_cfg(tmp_path, batch_size=2, accumulate=2, limit_train_batches="3"),
                                  8, 10)
    assert str(refused.value).startswith("--limit-train-batches: counts micro-batches, of 8 samples (all ranks) in "
                                         "the checkpoint's run and of 4 in this one"), str(refused.value)
    for flags, flag in (({}, "--epochs"), ({"max_steps": 3}, "--max-steps")):  # (constant: no schedule length)
        with pytest.raises(ckpt_mod.UsageError) as refused:
            ckpt_mod.check_compatible(_saved(tmp_path, step=5, schedule="constant"),
                                      make_cfg(tmp_path, schedule="constant", **flags), 32, 3)
        assert str(refused.value).startswith(f"{flag}: this run ends after 3 optimizer steps, before the "
                                             "checkpoint's step 5"), str(refused.value)


def test_checkpoint_without_samples_seen_resumes_from_0_and_first_line_is_at_most_160_characters(tmp_path):
    ckpt = _saved(tmp_path, progress={"micro_steps_done": 0})
    assert ckpt_mod.resume_point(ckpt, 32) == (0, 0, 5, 0, {})
    ckpt["progress"]["samples_seen"] = 160
    assert ckpt_mod.resume_point(ckpt, 32)[3] == 160
    assert ckpt_mod.first_line(RuntimeError("x" * 300 + "\nsecond")) == "x" * 160
    assert ckpt_mod.first_line(RuntimeError("")) == "RuntimeError"


def test_checkpoint_folders_no_link_points_at_are_removed_and_the_linked_ones_kept(tmp_path):
    for name in (".dcp-1", ".dcp-2", ".dcp-3"):
        (tmp_path / name).mkdir()
    (tmp_path / ".dcp-4").write_text("a file of that name is not a checkpoint folder: left alone")
    (tmp_path / "last.dcp").symlink_to(".dcp-3")
    (tmp_path / "best.dcp").symlink_to(".dcp-2")
    ckpt_mod.remove_unlinked_dcp(tmp_path)
    assert sorted(p.name for p in tmp_path.glob(".dcp-*")) == [".dcp-2", ".dcp-3", ".dcp-4"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_to_pt_writes_the_whole_checkpoint_and_never_over_a_file(tmp_path, capsys):
    folder, model, _ = _dcp_folder(tmp_path)
    out = tmp_path / "whole.pt"
    assert ckpt_mod.main(["--to-pt", str(folder), str(out)]) == 0
    whole = torch.load(out, weights_only=True)
    assert "format" not in whole and all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())
    assert capsys.readouterr().out == f"{folder} -> {out} (step 1, world size 1)\n"
    assert ckpt_mod.main(["--to-pt", str(folder), str(out)]) == 2
    assert capsys.readouterr().err == f"error: --to-pt: {out} exists; it is left as it is (allowed: a new file name)\n"
