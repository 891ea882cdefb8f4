"""Pipeline parallelism (launch/pipeline.py, manual_train/loops/pipeline.py, manual_train/pipeline.py).

Parity in 64-true (PARITY_TOL_64 = 1e-9) against the baseline (loops/single.py, one process, the same flags): two
ranks, one stage each, train the GPT on the reverse task for two epochs of 203 samples in batches of 30 (the epoch's
last batch 23), each batch cut into 4 micro-batches (8+8+7+7, and 6+6+6+5 for the last: uneven, exactly), with
accumulation over 2 batches and gradient clipping at 0.5 (the norm over both stages, the tied embedding counted
once): GPipe written out with send/recv, and torch.distributed.pipelining's 1f1b and interleaved-1f1b (two stages
per rank, the batch padded to equal micro-batches whose padded rows' targets are ignored). The known-wrong variant,
each micro-batch's mean loss weighted 1/m instead of by its share of the batch, fails the same check.
Measured 2026-12-01 (2-core AVX-512 Xeon, torch 2.14.1, other jobs running): explicit 4.7e-14, torch gpipe and
1f1b 5.9e-14, interleaved-1f1b 6.7e-14, the wrong weighting 1.3e-2; the file takes about a minute here. A resume
at one stage and at two stages is exact (Run(..., replicas=1): the stages share every batch). fp32, one epoch,
against a noise floor measured in the same test (conftest.fp32_noise_floor): floor 4.2e-5, GPipe 1.9e-5, the 1/m
weighting 1.1e-2 (fails the 10-floor bound).
Known-wrong variants in the pipeline's own code (tests/mutants/pipeline.py; make mutants): pipeline-tied-grad-not-summed,
pipeline-clip-per-stage-norm, pipeline-clip-tied-counted-twice and pipeline-stage-boundary-off-by-one fail the
explicit GPipe parity, pipeline-torch-scale-grads-twice the torch gpipe one, pipeline-micro-batches-weighted-1-over-m
the one-stage check.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import (assert_same_path_bitwise, PARITY_TOL_64, as_torchrun_rank, assert_within_fp32_floor, fp32_noise_floor,
                      load_model_state, make_cfg, max_param_diff, run_script, train_state)
from jobs import run_job
import manual_train.pipeline
from manual_train.bench import pipeline as bench_pipeline
from manual_train.config import Config, UsageError
from manual_train.loops import pipeline, single
from manual_train.models import loss_fn

M = 4
PARITY = dict(model="gpt", dataset="reverse", optimizer="adamw", lr=3e-3, synthetic_size=203, batch_size=30,
              accumulate=2, grad_clip=0.5, epochs=2, log_every=3, precision="64-true")
FP32 = dict(PARITY, precision="32-true", epochs=1)  # the fp32 check: one epoch, against a measured noise floor
SCENARIOS = {"explicit": dict(impl="explicit"), "wrong": dict(impl="explicit"),
             "explicit_fp32": dict(impl="explicit"), "wrong_fp32": dict(impl="explicit"),
             "torch_gpipe": dict(impl="torch", pipeline_schedule="gpipe"),
             "torch_1f1b": dict(impl="torch", pipeline_schedule="1f1b"),
             "torch_interleaved": dict(impl="torch", pipeline_schedule="interleaved-1f1b")}


def _scenario_resume(out: Path) -> dict:
    """Two epochs with a constant LR, stopped after 5 steps (mid-epoch) and resumed from last.pt; and unbroken."""
    flags = dict(PARITY, schedule="constant", microbatches=M)
    pipeline.train(make_cfg(out / "full", pipeline.PipelineConfig, **flags))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # each group its own keys in the one store (as torchrun's restarts)
    pipeline.train(make_cfg(out / "a", pipeline.PipelineConfig, max_steps=5, **flags))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "2"
    try:
        pipeline.train(make_cfg(out / "a", pipeline.PipelineConfig, resume="auto", **flags))
    except UsageError as e:
        return {"error": str(e)}
    finally:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
    return {"error": None}


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    if name == "resume":
        return _scenario_resume(out / name)
    real_share = manual_train.pipeline.share
    if name.startswith("wrong"):  # every micro-batch's mean loss weighted 1/m: the short ones' samples count more
        manual_train.pipeline.share = lambda logits, y, targets: loss_fn(logits, y) / M
    try:
        flags = FP32 if name.endswith("fp32") else PARITY
        cfg = make_cfg(out / name, pipeline.PipelineConfig, microbatches=M, **flags, **SCENARIOS[name])
        summary = pipeline.train(cfg)
    finally:
        manual_train.pipeline.share = real_share
    return {k: summary[k] for k in ("optimizer_steps", "samples_seen", "global_batch_size", "final_val_loss")}


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe2")
    return out, run_job(_scenario, 2, out, [*SCENARIOS, "resume"], ["manual_train.loops.pipeline",
                                                                     "manual_train.tokens"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    summary = single.train(make_cfg(out, Config, **PARITY))
    return load_model_state(out / "run"), summary


@pytest.mark.parametrize("name", ["explicit", "torch_gpipe", "torch_1f1b", "torch_interleaved"])
def test_two_stages_train_the_baselines_weights(name, job2, baseline):
    out, results = job2
    weights, summary = baseline
    diff = max_param_diff(load_model_state(out / name / "run"), weights)
    print(f"{name}: max abs weight diff vs single.py {diff:.3g}")
    assert diff <= PARITY_TOL_64, f"{name}: max abs diff {diff:.3g}"
    for r in results:  # every rank counted the same steps and samples; the logged val loss is the baseline's
        assert r[name]["optimizer_steps"] == summary["optimizer_steps"] == 2 * 4  # ceil(ceil(203/30)/2) a epoch
        assert r[name]["samples_seen"] == 2 * 203 and r[name]["global_batch_size"] == 60
        assert abs(r[name]["final_val_loss"] - summary["final_val_loss"]) < 1e-9


def test_equal_micro_batch_weights_fail_the_parity_check(job2, baseline):
    out, _ = job2
    diff = max_param_diff(load_model_state(out / "wrong" / "run"), baseline[0])
    print(f"1/m weights: {diff:.3g}")
    assert diff > 1e3 * PARITY_TOL_64


def test_fp32_two_stages_within_the_noise_floor_and_equal_weights_are_not(job2, tmp_path):
    """fp32, one epoch: GPipe's 2 stages (micro-batches summed in another order) drift from single.py by rounding,
    within FP32_FLOOR_FACTOR x the drift of single.py itself from one-ulp-nudged initial weights; 1/m weights
    do not."""
    out, _ = job2

    def baseline_weights(name: str) -> dict:
        return train_state(single, Config, tmp_path, name, **FP32)[0]

    reference = baseline_weights("fp32")
    floor = fp32_noise_floor(baseline_weights, reference)
    diff = max_param_diff(load_model_state(out / "explicit_fp32" / "run"), reference)
    assert_within_fp32_floor(diff, floor, "GPipe, 2 stages vs single.py")
    with pytest.raises(AssertionError):
        assert_within_fp32_floor(max_param_diff(load_model_state(out / "wrong_fp32" / "run"), reference), floor,
                                 "1/m weights vs single.py")


def test_a_two_stage_run_resumed_mid_epoch_ends_as_the_unbroken_one(job2):
    out, results = job2
    assert all(r["resume"]["error"] is None for r in results), results[0]["resume"]["error"]
    assert_same_path_bitwise(load_model_state(out / "resume" / "a" / "run"),
                             load_model_state(out / "resume" / "full" / "run"), "2 stages resumed vs unbroken")


def test_one_stage_resumed_mid_epoch_ends_as_the_unbroken_run(tmp_path, lone_process):
    """The gathered checkpoint (Pipeline.state_dict, wrap_optimizer) round-trips, in a group of one."""
    flags = dict(PARITY, schedule="constant", microbatches=M, epochs=1)
    pipeline.train(make_cfg(tmp_path / "full", pipeline.PipelineConfig, **flags))
    pipeline.train(make_cfg(tmp_path / "a", pipeline.PipelineConfig, max_steps=2, **flags))
    pipeline.train(make_cfg(tmp_path / "a", pipeline.PipelineConfig, resume="auto", **flags))
    ckpt = torch.load(tmp_path / "a" / "run" / "last.pt", weights_only=True)
    assert len(ckpt["optimizer"]["pipeline_stages"]) == 1 and ckpt["step"] == 4
    assert_same_path_bitwise(load_model_state(tmp_path / "a" / "run"), load_model_state(tmp_path / "full" / "run"),
                             "1 stage resumed vs unbroken")


def test_one_stage_in_micro_batches_is_the_baseline(tmp_path):
    flags = dict(PARITY, epochs=1)
    pipeline.train(make_cfg(tmp_path / "p", pipeline.PipelineConfig, microbatches=3, **flags))
    single.train(make_cfg(tmp_path / "s", Config, **flags))
    diff = max_param_diff(load_model_state(tmp_path / "p" / "run"), load_model_state(tmp_path / "s" / "run"))
    assert diff <= PARITY_TOL_64, f"1 stage, 3 micro-batches vs single.py: max abs diff {diff:.3g}"


def test_uneven_micro_batches_are_tensor_splits_and_padding_is_ignored():
    x, y = torch.arange(30).view(30, 1), torch.arange(30).view(30, 1)
    assert [len(c) for c, _ in manual_train.pipeline.micro_batches(x, y, 4)] == [8, 8, 7, 7]
    assert [len(c) for c, _ in manual_train.pipeline.micro_batches(x[:3], y[:3], 4)] == [1, 1, 1]  # no empty micro-batch
    padded = manual_train.pipeline.pad(y, 4, manual_train.pipeline.IGNORE)
    assert padded.shape == (32, 1) and (padded[30:] == manual_train.pipeline.IGNORE).all()


@pytest.mark.parametrize("args, env, expect", [
    (("--dp", "2"), {}, "--dp: pipeline x data parallel is not built here"),
    (("--model", "cnn", "--dataset", "digits"), {}, "--model: the pipeline splits the GPT's blocks"),
    (("--precision", "16-mixed"), {}, "--precision: 16-mixed"),
    (("--stages", "3"), {}, "--stages: 3 stages x --dp 1 != world size 1"),
    ((), dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
              MASTER_PORT="29999"), "--stages: 3 stages do not divide the GPT's 4 blocks"),
    (("--impl", "torch", "--pipeline-schedule", "interleaved-1f1b"), {},
     "--pipeline-schedule: interleaved-1f1b needs 2 or more ranks"),
    (("--impl", "torch", "--pipeline-schedule", "interleaved-1f1b"),
     dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
          MASTER_PORT="29999"), "8 stages do not divide the GPT's 4 blocks (interleaved-1f1b: two stages per rank)"),
])
def test_bad_input_is_one_line(args, env, expect):
    proc = run_script("pipeline", *args, "--no-progress", env=env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expect in proc.stderr, proc.stderr


@pytest.mark.parametrize("knob", [dict(sync_bn=True), dict(bucket_cap_mb=1), dict(gradient_as_bucket_view=True),
                                  dict(static_graph=True, accumulate=2), dict(find_unused_parameters=True),
                                  dict(comm_hook="fp16"), dict(powersgd_rank=2)], ids=lambda knob: next(iter(knob)))
def test_ddp_s_knobs_are_refused_not_ignored(tmp_path, monkeypatch, knob):
    """PipelineConfig takes launch/ddp.py's flags for its process group (a DDPConfig), but the pipeline builds no
    DistributedDataParallel: DDP's knobs would be accepted and do nothing. Each is one line naming launch/ddp.py, ahead
    of DDPConfig's own advice on it (--static-graph with --accumulate, PowerSGD's flags without --comm-hook powersgd);
    the same command without it is valid."""
    as_torchrun_rank(monkeypatch, world_size=2)
    flags = dict(model="gpt", dataset="reverse")
    make_cfg(tmp_path, pipeline.PipelineConfig, **flags)
    flag = "--" + next(iter(knob)).replace("_", "-")
    with pytest.raises(UsageError) as refused:
        make_cfg(tmp_path, pipeline.PipelineConfig, **flags, **knob)
    if flag == "--sync-bn":
        assert str(refused.value) == ("--sync-bn: the pipeline's GPT has no BatchNorm layers to synchronise "
                                      "(allowed: leave it out)")
    else:
        assert str(refused.value).startswith(f"{flag}: is a knob of the DDP loop's DistributedDataParallel; "
                                             "launch/pipeline.py builds none"), refused.value
        assert str(refused.value).endswith("(allowed: launch/ddp.py, or leave it out)"), refused.value


def test_the_bubble_benchmark_measures_finite_fractions_near_the_formula():
    """The benchmark's function, its 2 ranks forked from the forkserver tests/jobs.py warmed (not 2 imports of torch)."""
    rows = bench_pipeline.bubble_rows(stages=2, microbatches=(1, 2, 4, 8), steps=3, start_method="forkserver")
    assert [r["microbatches"] for r in rows] == [1, 2, 4, 8]
    for r in rows:
        assert all(0 <= f < 1 for f in r["idle_fraction_per_stage"]), r
        assert r["formula"] == pytest.approx((2 - 1) / (r["microbatches"] + 2 - 1))
    print("\n".join(str(r) for r in rows))
