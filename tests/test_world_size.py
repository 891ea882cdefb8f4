"""Checkpoints across world sizes (docs/checkpointing.md, "Another world size"): saved at 4 ranks, resumed at 2 and
at 1, the run ends where the uninterrupted one does, at an epoch's end and mid-epoch.

Two jobs run the loops in real gloo process groups (tests/jobs.py): at 4 ranks, the ZeRO loop with FSDP2 (--stage 2)
and --checkpoint-format dcp, and the DDP loop (last.pt), each stopped at an epoch's end (--epochs 1) and mid-epoch
(--max-steps 3); at 2 ranks, the same loops resume those checkpoints with another split of the same global batch
(4 ranks x 4 -> 2 ranks x 4 x accumulate 2) to the end of epoch 2, and a DDP run with dropout is saved. In this
process, launch/single.py's loop resumes the dcp checkpoints at world size 1 (directly, and as the .pt that
`python -m manual_train.checkpoint --to-pt` writes) and the uninterrupted single-process run is the reference.

64-true, within PARITY_TOL_64 = 1e-9 of the uninterrupted run; one fp32 pairing (dcp mid-epoch, 4 -> 2) within
FP32_FLOOR_FACTOR noise floors measured here. The known-wrong variants fail it: the mid-epoch position counted in the
checkpoint's per-rank micro-steps (the rule before `epoch_samples_done`; DDP in 64-true, FSDP2/dcp in fp32), and a
dropout run resumed at another world size with rank 0's RNG streams (what the loops did before the world-size check).
Measured (2026-12-01, 2-core Xeon, torch 2.14.1): see docs/checkpointing.md.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (PARITY_TOL_64, assert_within_fp32_floor, final_weights, fp32_noise_floor, make_cfg,
                      max_param_diff)
from jobs import run_job

from manual_train import checkpoint
from manual_train.cli import run
from manual_train.config import Config
from manual_train.loops import ddp, single
from manual_train.loops import zero as zero_loop

# 88 = 5 x 16 + 8 samples: 6 steps an epoch, the last a partial window; at 4 ranks the shards are 22 samples each
FLAGS = dict(model="mlp", dataset="synthetic", synthetic_size=88, synthetic_shape="1,8,8", synthetic_classes=4,
             optimizer="adamw", lr=1e-2, schedule="constant", precision="64-true", log_every=2, epochs=2)
GLOBAL_BATCH = 16
STOPS = {"boundary": dict(epochs=1), "mid": dict(max_steps=3)}  # where the saved runs stop: 6 of 12 steps; 3
SPLITS = {4: dict(batch_size=4), 2: dict(batch_size=4, accumulate=2), 1: dict(batch_size=16)}
FP32 = dict(precision="32-true")
DROPOUT = dict(dropout=0.3)
PRELOAD = ["manual_train.loops.zero", "manual_train.loops.ddp", "torch.distributed.checkpoint"]


def _train(loop: str, world_size: int, out: Path, **flags) -> dict:
    flags = {**FLAGS, **SPLITS[world_size], "dist_timeout_s": 60, **flags}
    if loop == "ddp":
        return ddp.train(make_cfg(out, ddp.DDPConfig, **flags))
    # "zero-dcp": FSDP2, every rank writes its shards
    return zero_loop.train(make_cfg(out, zero_loop.ZeroConfig, impl="torch", stage=2, checkpoint_format="dcp", **flags))


def per_rank_micro_steps(ckpt, micro_batch):
    """The known-wrong resume point: the checkpoint's micro-steps (of ITS split) taken as this run's."""
    epoch, _, step, samples_seen, best = checkpoint.resume_point(ckpt, micro_batch)
    return epoch, int(ckpt["progress"]["micro_steps_done"]), step, samples_seen, best


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    """<loop>[-fp32]_<stop> saves (4 ranks); <loop>[-fp32]_<stop>_at2[-wrong] resumes it (2 ranks);
    dropout_ref / dropout_boundary: DDP with dropout, uninterrupted and stopped at epoch 1 (2 ranks)."""
    from manual_train import run as run_module

    parts = name.split("_")
    if name == "async":  # a save every 2 steps in a background thread, the next one waiting for it: 6 saves
        summary = _train("zero-dcp", world_size, out / name, async_checkpoint=True, checkpoint_every_steps=2)
        return {"blocked": summary["checkpoint_blocked_s_per_save"]}
    if parts[0] == "dropout":
        _train("ddp", world_size, out / name, **DROPOUT, **({} if parts[1] == "ref" else STOPS["boundary"]))
        return {}
    loop, precision = parts[0].split("-fp32")[0], FP32 if "-fp32" in parts[0] else {}
    if len(parts) == 2:
        _train(loop, world_size, out / name, **precision, **STOPS[parts[1]])
        return {}
    saved = out.parent / f"job4/{parts[0]}_{parts[1]}/run"
    resume = saved / ("last.dcp" if loop == "zero-dcp" else "last.pt")
    real = run_module.resume_point
    if parts[2].endswith("-wrong"):
        run_module.resume_point = per_rank_micro_steps
    try:
        _train(loop, world_size, out / name, **precision, resume=str(resume))
    finally:
        run_module.resume_point = real
    return {}


SAVED = [f"{loop}_{stop}" for loop in ("zero-dcp", "ddp") for stop in STOPS] + ["zero-dcp-fp32_mid"]
RESUMED = [f"{s}_at2" for s in SAVED] + ["ddp_mid_at2-wrong", "zero-dcp-fp32_mid_at2-wrong"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    run_job(_scenario, 4, root / "job4", SAVED, PRELOAD)
    results = run_job(_scenario, 2, root / "job2", [*RESUMED, "dropout_ref", "dropout_boundary", "async"], PRELOAD)
    return root, results


def _single(tmp_path: Path, name: str, **flags) -> dict:
    single.train(make_cfg(tmp_path / name, **{**FLAGS, **SPLITS[1], **flags}))
    return final_weights(tmp_path / name / "run")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted single-process runs: 64-true, fp32, and fp32's noise floor."""
    root = tmp_path_factory.mktemp("ref")
    ref32 = _single(root, "ref32", **FP32)
    floor = fp32_noise_floor(lambda name: _single(root, name, **FP32), ref32)
    return _single(root, "ref64"), ref32, floor


# ---------------------------------------------------------------------- 4 -> 2 and 4 -> 1 equal the uninterrupted run
@pytest.mark.parametrize("saved", [s for s in SAVED if "fp32" not in s])
def test_saved_at_4_resumed_at_2_ends_where_the_uninterrupted_run_does(jobs, reference, saved):
    diff = max_param_diff(final_weights(jobs[0] / f"job2/{saved}_at2/run"), reference[0])
    print(f"{saved} 4 -> 2: {diff:.3g}")
    assert diff <= PARITY_TOL_64


def test_fp32_dcp_mid_epoch_4_to_2_within_the_noise_floor(jobs, reference):
    _, ref32, floor = reference
    """...and the known-wrong resume point (per-rank micro-steps) on the same FSDP2/DCP path fails the same check."""
    assert_within_fp32_floor(max_param_diff(final_weights(jobs[0] / "job2/zero-dcp-fp32_mid_at2/run"), ref32), floor,
                             "dcp mid-epoch 4 -> 2")
    with pytest.raises(AssertionError):
        assert_within_fp32_floor(max_param_diff(final_weights(jobs[0] / "job2/zero-dcp-fp32_mid_at2-wrong/run"), ref32),
                                 floor, "dcp mid-epoch 4 -> 2, position in per-rank micro-steps")


def test_mid_epoch_position_in_per_rank_micro_steps_is_wrong(jobs, reference):
    diff = max_param_diff(final_weights(jobs[0] / "job2/ddp_mid_at2-wrong/run"), reference[0])
    print(f"per-rank micro-steps: {diff:.3g}")
    assert diff > 1e3 * PARITY_TOL_64


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("how", ["direct", "to-pt"])
def test_dcp_saved_at_4_resumed_by_the_single_loop(jobs, reference, tmp_path, stop, how):
    """launch/single.py reads the folder itself, or the .pt `python -m manual_train.checkpoint --to-pt` wrote."""
    folder = jobs[0] / f"job4/zero-dcp_{stop}/run/last.dcp"
    resume = folder
    if how == "to-pt":
        resume = tmp_path / "converted.pt"
        assert checkpoint.main(["--to-pt", str(folder), str(resume)]) == 0
        assert checkpoint.main(["--to-pt", str(folder), str(resume)]) == 2  # never overwrites
    diff = max_param_diff(_single(tmp_path, "resumed", resume=str(resume)), reference[0])
    print(f"dcp {stop} 4 -> 1 ({how}): {diff:.3g}")
    assert diff <= PARITY_TOL_64


def test_evaluate_reads_a_dcp_folder_as_its_converted_pt(jobs, tmp_path, capsys):
    """python -m manual_train.evaluate takes a dcp folder (read whole) and gives what its --to-pt file gives."""
    import json

    from manual_train import evaluate

    folder = jobs[0] / "job4/zero-dcp_boundary/run/last.dcp"
    converted = tmp_path / "converted.pt"
    assert checkpoint.main(["--to-pt", str(folder), str(converted)]) == 0
    results = []
    for path in (folder, converted):
        capsys.readouterr()
        assert evaluate.main(["--checkpoint", str(path), "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["samples"] > 0 and results[0]["step"] == results[1]["step"]
    assert (results[0]["loss"], results[0]["acc"]) == (results[1]["loss"], results[1]["acc"])


def test_dcp_folder_is_a_link_to_a_complete_checkpoint(jobs):
    run_dir = jobs[0] / "job4/zero-dcp_boundary/run"
    link = run_dir / "last.dcp"
    assert link.is_symlink() and (link / ".metadata").is_file() and (link / checkpoint.DCP_META).is_file()
    assert [p.name for p in run_dir.glob(".dcp-*")] == [link.readlink().name]  # older folders removed
    assert not list(run_dir.glob("last.pt"))
    assert Config(resume="auto", out_dir=str(run_dir)).resume_path() == link  # --resume auto finds it


def test_a_killed_writers_folder_is_never_named_and_goes_at_the_next_save(jobs, tmp_path):
    """A save killed mid-write leaves a .dcp-* folder that no link names: last.dcp still loads the previous
    checkpoint whole, and the next commit (remove_unlinked_dcp) removes the orphan."""
    run_dir = tmp_path / "run"
    shutil.copytree(jobs[0] / "job4/zero-dcp_mid/run", run_dir, symlinks=True)
    target = (run_dir / "last.dcp").readlink()
    half = run_dir / ".dcp-99999-dead00"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half")  # no .metadata, no meta.pt: what a killed save leaves
    assert checkpoint.load_checkpoint(run_dir / "last.dcp")["step"] == 3
    checkpoint.link_atomically(run_dir / "last.dcp", target.name)  # what the next commit does, then:
    checkpoint.remove_unlinked_dcp(run_dir)
    assert not half.exists() and (run_dir / "last.dcp").readlink() == target


# ---------------------------------------------------------------------- per-rank RNG: refused, and why
def test_dropout_at_another_world_size_is_refused_and_taking_rank_0s_streams_is_wrong(jobs, tmp_path, capsys,
                                                                                      monkeypatch):
    resume = jobs[0] / "job2/dropout_boundary/run/last.pt"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in {**FLAGS, **SPLITS[1], **DROPOUT}.items()]
    out = tmp_path / "refused"
    assert run(single.train, script="single", argv=[*argv, "--no-progress", "--resume", str(resume),
                                                    "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 2, this run has 1" in err[0] and "--dropout 0.3" in err[0], err
    assert not out.exists()
    # the check skipped: every rank (here the one) takes rank 0's streams; the masks differ from the 2-rank run's
    monkeypatch.setattr(checkpoint, "check_world_size_change", lambda *a, **k: None)
    diff = max_param_diff(_single(tmp_path, "wrong", resume=str(resume), **DROPOUT),
                          final_weights(jobs[0] / "job2/dropout_ref/run"))
    print(f"dropout, rank 0's streams at another world size: {diff:.3g}")
    assert diff > 1e3 * PARITY_TOL_64


# ---------------------------------------------------------------------- bad input: one line, exit 2, nothing written
@pytest.mark.parametrize("argv, flag", [
    (["--stage", "1", "--checkpoint-format", "dcp"], "--checkpoint-format"),
    (["--impl", "fairscale", "--stage", "2", "--checkpoint-format", "dcp"], "--checkpoint-format"),
    (["--async-checkpoint"], "--async-checkpoint"),
])
def test_checkpoint_format_where_it_cannot_work_is_one_line(tmp_path, capsys, argv, flag):
    out = tmp_path / "run"
    assert run(zero_loop.train, zero_loop.ZeroConfig, script="zero", argv=[*argv, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}:"), err
    assert not out.exists()


def test_corrupt_or_foreign_dcp_folders_are_one_line_errors(jobs, tmp_path, capsys):
    good = jobs[0] / "job4/zero-dcp_boundary/run/last.dcp"
    broken = {"empty": [], "no meta": [".metadata", "__0_0.distcp"], "no shards": [".metadata", "meta.pt"]}
    for name, files in broken.items():
        folder = tmp_path / name
        folder.mkdir()
        for f in files:
            (folder / f).write_bytes((good / f).read_bytes())
        out = tmp_path / f"out-{name}"
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in {**FLAGS, **SPLITS[1]}.items()]
        assert run(single.train, script="single", argv=[*argv, "--no-progress", "--resume", str(folder),
                                                        "--out-dir", str(out)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --resume:"), (name, err)
        assert not out.exists(), name


# ---------------------------------------------------------------------- --async-checkpoint
def test_async_checkpoints_are_complete_and_training_is_unchanged(jobs, reference):
    """6 saves in a background thread (dcp.async_save), each waited for by the next: the last one holds the
    uninterrupted run's weights, only its folder is left, and every save's blocked time is in summary.json."""
    root, results = jobs
    run_dir = root / "job2/async/run"
    assert max_param_diff(final_weights(run_dir), reference[0]) <= PARITY_TOL_64
    linked = {(run_dir / name).readlink().name for name in ("last.dcp", "best.dcp")}
    assert {p.name for p in run_dir.glob(".dcp-*")} == linked  # the older folders removed
    blocked = results[0]["async"]["blocked"]
    assert len(blocked) == 6 and all(0 < b < 60 for b in blocked), blocked


def test_the_checkpoint_io_benchmark_runs(lone_process):
    """manual_train/bench/checkpoint_io.py (the CPU suite's checkpoint_io): every variant's blocked seconds (here in
    this process, a group of one: the suite's 2 processes would cost ~10 s of imports and start-up)."""
    from manual_train.bench.checkpoint_io import VARIANTS, blocked_rows

    rows = blocked_rows(world_size=1, steps=2, every=1, shape="1,8,8")
    assert [r["variant"] for r in rows] == list(VARIANTS)
    assert all(len(r["blocked_s"]) == 2 and all(0 < b < 60 for b in r["blocked_s"]) for r in rows), rows


@pytest.mark.parametrize("script, dataset, words", [
    ("hybrid", "synthetic", "the hybrid loop.s resume is proven at its own world size only"),
])
def test_the_other_per_rank_cases_are_refused_naming_both_sizes(script, dataset, words):
    ckpt = {"world_size": 4, "config": {"batch_size": 4}, "progress": {"micro_steps_done": 3}}
    cfg = SimpleNamespace(dropout=0.0, dataset=dataset)  # the two fields the check reads
    with pytest.raises(checkpoint.UsageError, match=f"world size 4, this run has 2: {words}"):
        checkpoint.check_world_size_change(ckpt, cfg, 2, script=script)
    # cifar10's augmentation is drawn per sample (data.PerSampleRNG, tests/test_augmentation.py): it moves with them
    for allowed in ("synthetic", "cifar10"):
        checkpoint.check_world_size_change(ckpt, SimpleNamespace(dropout=0.0, dataset=allowed), 2, script="ddp")
    assert checkpoint.epoch_samples_done(ckpt) == 3 * 4 * 4  # a checkpoint written before epoch_samples_done
