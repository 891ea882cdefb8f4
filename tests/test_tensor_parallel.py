"""Tensor parallelism and 2-D FSDP2 x TP (launch/tensor_parallel.py, manual_train/loops/tensor_parallel.py,
manual_train/tensor_parallel.py), and its sharded checkpoints (--checkpoint-format dcp) across world sizes.

Parity in 64-true (PARITY_TOL_64 = 1e-9) against the baseline (loops/single.py, one process, the same flags): the
GPT of 2 blocks (TP_LAYERS) on the reverse task, 100 samples in batches of 16 (the epoch's last batch 4),
accumulation over 2 batches, gradient clipping at 0.5 (DTensor norms), AdamW: --tp 2 on 2 ranks (every rank the same
batches) and --dp 2 --tp 2 on 4 (FSDP2 over 2 replicas of batch 8, the epoch's last micro-batches 2 and 2), each
also with --sequence-parallel. fp32: --tp 2 within 10 noise floors measured here (the baseline's drift from a
one-ulp change of its initial weights). Known-wrong variants that must fail, each monkeypatched here: attention
viewing a rank's C/tp columns as a fixed n_head heads (in place of models.py's -1: n_head/tp heads), and the layers
left unsharded (tensor_parallel.replicate a no-op) under the default (fused) and the foreach AdamW (the
DTensor/foreach trap: optimizer.step raises). Resumes: a --tp 2 run from its own last.pt mid-epoch; the
--dp 2 --tp 2 run's last.dcp (sharded, saved at the epoch's end) by launch/single.py's loop at world size 1 to the
end of epoch 2, and a --dp 2 --tp 2 run's last.dcp saved mid-epoch (asynchronously) resumed at --tp 2 on 2 ranks:
each ends equal to the uninterrupted run. Measured numbers: docs/tensor_parallel.md.
The known-wrong variants of the --sequence-parallel, fp32 and 2-D checks are mutants of the technique's code
(tests/mutants/tensor_parallel.py; make mutants): tensor-parallel-sp-norm-grads-not-reduced fails the sp parity,
tensor-parallel-row-output-not-reduced the fp32 noise-floor bound, tensor-parallel-2d-sampler-over-all-ranks the
--dp 2 --tp 2 parity; tensor-parallel-fixed-head-count and tensor-parallel-untied-head the --tp 2 parity.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import (assert_same_path_bitwise, PARITY_TOL_64, as_torchrun_rank, assert_within_fp32_floor, final_weights, fp32_noise_floor,
                      assert_gpt_blocks, gpt_blocks, load_model_state, make_cfg, max_param_diff, run_ok, torchrun)
from jobs import run_job
from manual_train import models
from manual_train.config import Config, UsageError
from manual_train.loops import single, tensor_parallel

PARITY = dict(model="gpt", dataset="reverse", optimizer="adamw", lr=3e-3, synthetic_size=100, batch_size=16,
              accumulate=2, grad_clip=0.5, epochs=1, log_every=2, schedule="constant")  # constant: see the resume
F64 = dict(precision="64-true")
SCENARIOS2 = {"tp2": F64, "tp2_fp32": dict(), "fixed_heads": F64, "sp": dict(F64, sequence_parallel=True)}
# The GPT's blocks in this file's runs (4 by default): each block is split alike (the same plan on every block), so
# what TP can get wrong shows in one block's layers, and 2 keep the residual stream between blocks; ~60% of the
# ranks' CPU of 4 (tests/test_text.py measured the same). The launch-script smoke run keeps the 4.
TP_LAYERS = 2
SCENARIOS4 = {"dp2tp2": dict(F64, checkpoint_format="dcp"), "dp2tp2_sp": dict(F64, sequence_parallel=True),
              "dcp_mid": dict(F64, checkpoint_format="dcp", async_checkpoint=True, max_steps=2)}  # 2 of 4 steps


def _train(out: Path, **flags) -> dict:
    return tensor_parallel.train(make_cfg(out, tensor_parallel.TensorParallelConfig, **flags))


def _fixed_head_count(self, x):
    """The known-wrong view: a rank's C/tp columns cut into n_head heads of head_dim/tp (models.py counts the heads)."""
    B, T, C = x.shape
    q, k, v = (lin(x).view(B, T, self.n_head, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


def _scenario_resume(out: Path) -> dict:
    """The tp2 scenario stopped after 2 steps (mid-epoch) and resumed from last.pt: it must end as tp2 did. (A
    constant LR: --max-steps would otherwise shorten the cosine schedule the checkpoint follows.)"""
    flags = dict(PARITY, precision="64-true")
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # each group its own keys in the one store (as torchrun's restarts)
    _train(out, max_steps=2, **flags)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "2"
    try:
        _train(out, resume="auto", **flags)
    finally:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
    return {}


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        gpt_blocks(patch, TP_LAYERS)  # (the ranks are forked from the forkserver: the module fixture is not theirs)
        if name == "resume":
            return _scenario_resume(out / name)
        if name == "dcp_mid_at2":  # 4 ranks' shards, saved mid-epoch, read at 2 (DCP reshards them)
            _train(out / name, **PARITY, **F64, resume=str(out.parent / "job4/dcp_mid/run/last.dcp"))
            return {}
        batch = dict(batch_size=8, dp=2, tp=2) if world_size == 4 else {}
        flags = {**PARITY, **batch, **(SCENARIOS4 if world_size == 4 else SCENARIOS2)[name]}
        if name == "fixed_heads":
            patch.setattr(models.CausalSelfAttention, "forward", _fixed_head_count)
        summary = _train(out / name, **flags)
    return {k: summary[k] for k in ("optimizer_steps", "samples_seen", "final_val_loss")}


PRELOAD = ["manual_train.loops.tensor_parallel", "manual_train.tokens", "torch.distributed.tensor.parallel",
           "torch.distributed.checkpoint"]


@pytest.fixture(scope="module", autouse=True)
def two_blocks():
    """This process's runs (the baselines, the fp32 floor, the trap, the compile, the single loop's resume) on the
    GPT of TP_LAYERS blocks, as the jobs' ranks (_scenario)."""
    with pytest.MonkeyPatch.context() as patch:
        gpt_blocks(patch, TP_LAYERS)
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def job4(root):
    return root / "job4", run_job(_scenario, 4, root / "job4", list(SCENARIOS4), PRELOAD)


@pytest.fixture(scope="module")
def job2(root, job4):  # after job4: dcp_mid_at2 resumes its checkpoint
    return root / "job2", run_job(_scenario, 2, root / "job2", [*SCENARIOS2, "resume", "dcp_mid_at2"], PRELOAD)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    summary = single.train(make_cfg(out, Config, **PARITY, precision="64-true"))
    weights = load_model_state(out / "run")
    assert_gpt_blocks(weights, TP_LAYERS)
    return weights, summary


@pytest.mark.parametrize("name", ["tp2", "sp"])
def test_tp2_trains_the_baselines_weights(name, job2, baseline):
    out, results = job2
    weights, summary = baseline
    diff = max_param_diff(load_model_state(out / name / "run"), weights)
    print(f"--tp 2 ({name}): max abs weight diff vs single.py {diff:.3g}")
    assert diff <= PARITY_TOL_64, f"--tp 2 ({name}) vs single.py: max abs diff {diff:.3g}"
    for r in results:  # every rank the same steps and samples; the logged val loss is the baseline's
        assert r[name]["optimizer_steps"] == summary["optimizer_steps"] == 4  # ceil(ceil(100/16)/2)
        assert r[name]["samples_seen"] == 100
        assert abs(r[name]["final_val_loss"] - summary["final_val_loss"]) < 1e-9


@pytest.mark.parametrize("name", ["dp2tp2", "dp2tp2_sp"])
def test_dp2_tp2_trains_the_baselines_weights(name, job4, baseline):
    out, results = job4
    weights, summary = baseline
    diff = max_param_diff(final_weights(out / name / "run"), weights)  # dp2tp2: its last.dcp, read whole
    print(f"--dp 2 --tp 2 ({name}): max abs weight diff vs single.py {diff:.3g}")
    assert diff <= PARITY_TOL_64, f"--dp 2 --tp 2 ({name}) vs single.py: max abs diff {diff:.3g}"
    for r in results:
        assert r[name]["optimizer_steps"] == 4 and r[name]["samples_seen"] == 100
        assert abs(r[name]["final_val_loss"] - summary["final_val_loss"]) < 1e-9


def test_tp2_in_fp32_is_within_the_noise_floor(job2, tmp_path):
    out, _ = job2

    def train_fn(name):
        single.train(make_cfg(tmp_path / name, Config, **PARITY))
        return load_model_state(tmp_path / name / "run")

    reference = train_fn("fp32")
    diff = max_param_diff(load_model_state(out / "tp2_fp32" / "run"), reference)
    assert_within_fp32_floor(diff, fp32_noise_floor(train_fn, reference), "--tp 2")


def test_a_fixed_head_count_fails_the_parity_check(job2, baseline):
    out, _ = job2
    diff = max_param_diff(load_model_state(out / "fixed_heads" / "run"), baseline[0])
    print(f"n_head heads of head_dim/tp on each rank: {diff:.3g}")
    assert diff > 1e3 * PARITY_TOL_64


@pytest.mark.parametrize("impl", [None, "foreach"])  # None: the default, fused on the CPU
def test_an_unsharded_layer_is_the_dtensor_trap(impl, tmp_path, lone_process, monkeypatch):
    """One process, --tp 1: the split layers are DTensors all the same, the others plain without replicate().
    (--optimizer-impl for-loop steps one tensor at a time and runs: the other way out, slower.)"""
    monkeypatch.setattr("manual_train.tensor_parallel.replicate", lambda raw_model, mesh: None)
    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
        _train(tmp_path, **dict(PARITY, synthetic_size=32, max_steps=1, optimizer_impl=impl))


def test_a_tp2_run_resumed_mid_epoch_ends_as_the_unbroken_one(job2):
    out, _ = job2
    assert_same_path_bitwise(load_model_state(out / "resume" / "run"), load_model_state(out / "tp2" / "run"),
                             "TP 2 resumed vs unbroken")


def test_dcp_saved_at_4_mid_epoch_resumed_at_2_ends_as_the_uninterrupted_run(job2, baseline):
    out, _ = job2
    diff = max_param_diff(final_weights(out / "dcp_mid_at2" / "run"), baseline[0])
    print(f"dcp (dp 2, tp 2) mid-epoch, async -> --tp 2: {diff:.3g}")
    assert diff <= PARITY_TOL_64, diff


def test_dcp_saved_at_4_at_the_epochs_end_resumed_by_the_single_loop(job4, tmp_path):
    """launch/single.py reads the (dp 2, tp 2) shards whole and trains epoch 2: as the uninterrupted 2 epochs."""
    out, _ = job4
    flags = dict(PARITY, precision="64-true", epochs=2)
    single.train(make_cfg(tmp_path / "ref", Config, **flags))
    single.train(make_cfg(tmp_path / "resumed", Config, **flags, resume=str(out / "dp2tp2/run/last.dcp")))
    diff = max_param_diff(load_model_state(tmp_path / "resumed/run"), load_model_state(tmp_path / "ref/run"))
    print(f"dcp (dp 2, tp 2) epoch's end -> single.py: {diff:.3g}")
    assert diff <= PARITY_TOL_64, diff


def test_compile_blocks_captures_the_dtensor_blocks_and_trains_as_eager(tmp_path, lone_process):
    """One process, --tp 1 (the blocks are DTensor modules all the same; 2 ranks would cost ~22 s of compiling
    here, measured by hand: docs/tensor_parallel.md): every block one graph, no break, the eager baseline's weights."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    flags = dict(PARITY, synthetic_size=64, precision="64-true")
    single.train(make_cfg(tmp_path / "eager", Config, **flags))
    torch._dynamo.reset()
    counters.clear()
    _train(tmp_path / "compiled", **flags, compile="blocks")
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    diff = max_param_diff(load_model_state(tmp_path / "compiled/run"), load_model_state(tmp_path / "eager/run"))
    print(f"--tp 1 --compile blocks: {graphs} graphs, {breaks} breaks, {diff:.3g} from eager single.py")
    torch._dynamo.reset()
    assert graphs > 0 and breaks == 0 and diff <= PARITY_TOL_64, (graphs, dict(counters["graph_break"]), diff)


@pytest.mark.parametrize("world, flags, expect", [
    (2, dict(model="cnn", dataset="digits"), "--model: tensor parallelism splits the GPT's"),
    (8, dict(tp=8), "--tp: 8 does not divide the GPT's n_head (4)"),
    (3, dict(), "--tp: 3 does not divide the GPT's n_head (4)"),
    (4, dict(dp=2, tp=4), "--tp: --dp 2 x --tp 4 != world size 4"),
    (4, dict(dp=3), "--dp: 3 does not divide the world size 4"),
    (4, dict(dp=2, stage=1), "--stage: ZeroRedundancyOptimizer does not take DTensor parameters"),
    (2, dict(async_checkpoint=True), "--async-checkpoint: "),
    (2, dict(compile="model"), "--compile: compiling the whole DTensor model is not built here"),
])
def test_bad_input_is_one_line(world, flags, expect, monkeypatch, tmp_path):
    as_torchrun_rank(monkeypatch, world_size=world)
    with pytest.raises(UsageError) as e:
        make_cfg(tmp_path, tensor_parallel.TensorParallelConfig, **{**dict(model="gpt", dataset="reverse"), **flags})
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_torchrun_smoke_and_the_checkpoint_is_the_baselines_layout(tmp_path):
    proc = run_ok("tensor_parallel", "--synthetic-size", "64", "--epochs", "1", "--out-dir", str(tmp_path / "t"),
                  "--no-progress", launcher=torchrun(2))
    assert "DeviceMesh (dp 1, tp 2)" in proc.stdout and "done:" in proc.stdout
    state = torch.load(tmp_path / "t" / "last.pt", weights_only=True)["model"]
    assert state["blocks.0.attn.q.weight"].shape == (64, 64) and not any("_local" in k for k in state)


def test_the_bytes_benchmark_is_near_the_formulas():
    from manual_train.bench.tensor_parallel import measure

    (row,) = measure(shapes=((1, 2, False),), batch=8, start_method="forkserver")  # (tests/jobs.py's warm server)
    print(row)
    assert all(abs(h / row["held_formula"] - 1) < 0.05 for h in row["held_per_rank"]), row
    assert all(abs(c / row["comm_formula"]["tp"] - 1) < 0.05 for c in row["comm_per_rank"]), row
