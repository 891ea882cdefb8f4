"""ZeRO (manual_train/loops/zero.py) against plain DDP, in real gloo process groups, and the torchrun CLI pairing.

Three jobs run the loops in real processes, each rank calling `zero.train` / `ddp.train` with torchrun's environment
set by hand (as tests/test_ddp_parity.py does; here with a store hosted by the test process, as torchrun's agent
hosts one), scenario after scenario, and writing each rank's results to a JSON file that the tests below assert on:
the parity matrix at 2 ranks (job2), its plain column at 4 ranks (job4), and checkpoints, memory and precision at 2
ranks (job2_state). Every parity scenario is AdamW (lr 1e-3, constant schedule), global batch 128, two epochs of
digits at 2 ranks (24 optimizer steps; 1500 = 11 x 128 + 92, so each epoch ends in a partial window) and one at 4
(12 steps, the partial window included: 4 processes on 2 cores cost twice as much per step), compared with DDP
under the same flags in the same job.

The proof runs in 64-true (float64 weights, inputs and optimizer state), where the bound does not depend on the CPU:
PARITY_TOL_64 = 1e-9. The model is the mlp: sharding, clipping over shards, the zeroing trap and the resume are
properties of the loop, not of the layers, and the cnn in float64 cost 2.4x the CPU of the whole file (its ranks: 118
against 49 CPU seconds, 2026-12-06, 2-core Xeon). Measured (2026-12-06, 2-core Xeon VM, AVX-512, torch 2.14.1): every
(impl, stage, variant) at 2 and 4 ranks 0.0 to 5.6e-17 from DDP; the zero_grad trap 1.9e-2 (1.9e7 x the bound).
The memory checks and the summary's bytes use the cnn (measure_rank's one step). One fp32 pairing (mlp,
2 ranks, plain, the same horizon) is held to a noise floor measured in the same job: how far DDP itself drifts when
its initial weights move by one ulp (DDP is ZeRO's parent and the reference the ZeRO runs are compared with; the
nudge runs in the ranks, conftest.initial_weights_nudged on manual_train.loops.ddp). Measured: floor 1.3e-6, every
(impl, stage) 0.0 (bitwise), the trap 1.9e-2.

What is proven here (docs/zero.md cites these names):
  parity ............ every CPU-capable (impl, stage) == DDP in 64-true within 1e-9 at 2 ranks plain,
                      --accumulate 2, --grad-clip (and clipping really clipped: it changes the weights), at 4 plain;
                      --restore-best's reload into the shards gives DDP's validation loss; in fp32 (mlp) within
                      10 noise floors of DDP
  the zero_grad trap  fairscale stage 2, default reduce buffers, optimizer.zero_grad(): far from DDP in 64-true and
                      outside the fp32 floor bound; the loop's zeroing: equal
  checkpoints ....... each impl's last.pt holds DDP's model and optimizer state at the same step (the plain
                      layout, float64 in 64-true); resuming it mid-epoch ends where the uninterrupted run did;
                      launch/single.py resumes a ZeRO checkpoint and this loop a DDP one; DCP's sharded save/load
                      round-trips FSDP2's shards
  memory ............ per-rank bytes at N = 2, 4 against DDP/N and the largest tensor; summary.json = measure_rank
                      (manual_train/bench/zero_memory.py)
  precision ......... 16-mixed composes (FSDP2's MixedPrecisionPolicy + ShardedGradScaler; OSS + GradScaler)
  the CLI ........... torchrun launch/zero.py --stage 3 vs the DDP loop, the parity flags (64-true, two epochs, its
                      sharded last.dcp read whole; one (S, I): the matrix above covers the others in-process)

The known-wrong variants of torch ZeRO-1, FSDP2 and fairscale are mutants of their code (tests/mutants/zero.py), each
killed by one case here with the job cut to its two scenarios (make mutants: zero-sharded-ddp-optimizer-zero-grad,
zero-oss-clip-local-norm, zero-fsdp2-clip-local-shard-norm by the parity matrix; zero-optimizer-state-not-consolidated
by the checkpoint check; zero-fsdp2-reshard-after-forward-inverted by the stage 3 memory check).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (FP32_MODEL, PARITY_TOL_64, ZERO_TORCHRUN_FLAGS, assert_within_fp32_floor, final_weights,
                      initial_weights_nudged, load_model_state, make_cfg, max_param_diff)
from jobs import run_job

from manual_train.bench.zero_memory import measure_per_rank_bytes, measure_rank
from manual_train.cli import run
from manual_train.loops import ddp, single
from manual_train.loops import zero as zero_loop
from manual_train.zero import CPU_CAPABLE, ZeroConfig

# Two epochs of few, large steps: the runs cost their samples' compute plus a per-step overhead (FSDP's hooks and
# collectives, 4 processes on 2 cores), so global batch 128 costs 25-35% less CPU than 64 for the same proof.
GLOBAL_BATCH = 128
PARITY_EPOCHS = 2  # 2 x 12 steps: 11 full windows of 128 and a partial one of 92 in each epoch
STEPS = 2 * 12
EPOCHS_AT = {2: PARITY_EPOCHS, 4: 1}  # 4 ranks: one epoch (its partial window too), the plain variant alone
FLAGS = dict(model="mlp", optimizer="adamw", lr=1e-3, schedule="constant", epochs=PARITY_EPOCHS,
             precision="64-true", dist_timeout_s=120, log_every=8)
# The clip variant also takes the --restore-best path at the end (best.pt is the last epoch's: the same weights).
VARIANTS = {"plain": {}, "accumulate": {"accumulate": 2}, "clip": {"grad_clip": 0.05, "restore_best": True}}
IMPL_STAGES = [f"{impl}{stage}" for impl, stage in CPU_CAPABLE]  # torch1 torch2 torch3 fairscale1 fairscale2
FP32 = dict(model=FP32_MODEL, precision="32-true")  # the fp32 pairing: mlp (conftest: the cnn's floor is too coarse)
HALF_STEPS = 14  # the checkpoint runs stop 2 steps into the second epoch; resuming replays the sampler's order
PRECISION_STEPS = 4
SUMMARY_STEPS = 6


def _name_to_impl_stage(name: str) -> tuple[str, int]:
    return name[:-1], int(name[-1])


# ---------------------------------------------------------------------- the scenarios, run inside each rank
def wrong_zero_grad(sharded):
    """The trap: torch's optimizer.zero_grad() (set_to_none=True) under ShardedDDP's default reduce buffers."""
    sharded.optimizer.zero_grad()


def _train(world_size: int, out: Path, loop: str, variant: str = "plain", **flags) -> dict:
    """One run of the zero loop (loop = 'torch3', ...) or the DDP loop (loop = 'ddp') with the parity flags."""
    flags = {**FLAGS, "epochs": EPOCHS_AT[world_size], **VARIANTS[variant], **flags}
    flags["batch_size"] = GLOBAL_BATCH // world_size // flags.get("accumulate", 1)
    if loop == "ddp":
        summary = ddp.train(make_cfg(out, ddp.DDPConfig, **flags))
    else:
        impl, stage = _name_to_impl_stage(loop)
        summary = zero_loop.train(make_cfg(out, zero_loop.ZeroConfig, impl=impl, stage=stage, **flags))
    return {k: summary.get(k) for k in ("final_val_loss", "optimizer_steps", "global_batch_size", "skipped_steps",
                                        "per_rank_bytes", "zero_formula_bytes")}


def _with_trap(fn):
    """Run fn with fairscale stage 2's zeroing (sharded.zero_grad()) swapped for the trap (the loop itself
    otherwise)."""
    from manual_train.zero_fairscale import OSSWithShardedDDP

    real = OSSWithShardedDDP.zero_grad
    OSSWithShardedDDP.zero_grad = wrong_zero_grad
    try:
        return fn()
    finally:
        OSSWithShardedDDP.zero_grad = real


def _scenario(name: str, world_size: int, out: Path) -> dict:
    loop, _, variant = name.partition("_")
    if variant == "wrong_zero_grad":  # 64-true, the plain flags
        return _with_trap(lambda: _train(world_size, out, loop))
    if variant == "fp32":  # the fp32 pairing: mlp, plain, two epochs
        return _train(world_size, out, loop, **FP32)
    if variant == "fp32-wrong_zero_grad":
        return _with_trap(lambda: _train(world_size, out, loop, **FP32))
    if variant in ("fp32-ulp-up", "fp32-ulp-down"):  # the fp32 noise floor: DDP from initial weights one ulp away
        assert loop == "ddp"
        with initial_weights_nudged(ddp, 1 if variant.endswith("up") else -1):
            return _train(world_size, out, loop, **FP32)
    if variant == "half":  # the plain run stopped 2 steps into epoch 2: last.pt after 14 of its 24 steps
        return _train(world_size, out, loop, max_steps=HALF_STEPS)
    if variant == "resumed":  # continues the half run's last.pt (its own loop's) to the end of epoch 2
        return _train(world_size, out, loop, resume=str(out.parent / f"{loop}_half" / "run" / "last.pt"))
    if variant == "from-ddp":  # continues DDP's half run
        return _train(world_size, out, loop, resume=str(out.parent / "ddp_half" / "run" / "last.pt"))
    if variant in ("16-mixed",):  # fp16 is slow on this CPU: a few steps
        return _train(world_size, out, loop, precision=variant, max_steps=PRECISION_STEPS)
    if variant == "summary":  # fp32 cnn, a few steps: the summary's bytes against measure_rank's (fp32 cnn)
        return _train(world_size, out, loop, model="cnn", precision="32-true", max_steps=SUMMARY_STEPS)
    return _train(world_size, out, loop, variant)


def _scenario_memory() -> dict:
    """measure_rank: one step of DDP (stage 0) and each CPU-capable (impl, stage), bytes held by this rank."""
    rows = measure_rank([("ddp", 0), *CPU_CAPABLE])
    rows += [{**r, "impl": "fairscale-buffer0"} for r in measure_rank([("fairscale", 2)], reduce_buffer_size=0)]
    return {f"{r['impl']}{r['stage']}": r for r in rows}


def _scenario_sharded_checkpoint(out: Path) -> dict:
    """FSDP2 stage 3 after a step, saved with DCP (each rank its shards) and read into a fresh sharded model."""
    from manual_train.checkpoint import load_sharded, save_sharded
    from manual_train.data import DataInfo
    from manual_train.distributed import read_env, setup, teardown
    from manual_train.models import build_model, loss_fn
    from manual_train.optim import build_optimizer
    from manual_train.zero import shard

    info, cfg = DataInfo("digits", (1, 8, 8), 10), ZeroConfig(optimizer="adamw", impl="torch", stage=3)
    setup(read_env(), torch.device("cpu"), "gloo", 120)
    try:
        def sharded(seed):
            torch.manual_seed(seed)
            raw = build_model("cnn", info)
            zero = shard(raw, build_optimizer(cfg, raw.parameters(), 1e-3), cfg, torch.device("cpu"))
            return raw, zero.model, zero.optimizer

        raw, model, optimizer = sharded(0)
        loss_fn(model(torch.randn(4, 1, 8, 8)), torch.randint(0, 10, (4,))).backward()
        optimizer.step()
        save_sharded(raw, optimizer, out)
        raw2, _, optimizer2 = sharded(1)  # other weights, no optimizer state yet
        load_sharded(raw2, optimizer2, out)

        def local(tensors):
            return torch.cat([t.to_local().reshape(-1) for t in tensors])

        state = [optimizer.state[p][k] for p in raw.parameters() for k in ("exp_avg", "exp_avg_sq")]
        state2 = [optimizer2.state[p][k] for p in raw2.parameters() for k in ("exp_avg", "exp_avg_sq")]
        return {"params_diff": (local(raw.parameters()) - local(raw2.parameters())).abs().max().item(),
                "state_diff": (local(state) - local(state2)).abs().max().item(),
                "files": sorted(p.name for p in out.iterdir())}
    finally:
        teardown()


def _scenario_any(name: str, world_size: int, rank: int, out: Path) -> dict:
    """One scenario on one rank (tests/jobs.py runs them in order on every rank, each a new group)."""
    if name == "memory":
        from manual_train.distributed import read_env, setup, teardown

        setup(read_env(), torch.device("cpu"), "gloo", 120)
        try:
            return _scenario_memory()
        finally:
            teardown()
    if name == "sharded_checkpoint":
        return _scenario_sharded_checkpoint(out / name)
    return _scenario(name, world_size, out / name)


PRELOAD = ["manual_train.loops.zero", "manual_train.loops.single", "manual_train.zero_fairscale",
           "manual_train.bench.zero_memory", "torch.distributed.checkpoint"]


MATRIX = [f"{loop}_{variant}" for loop in ["ddp", *IMPL_STAGES] for variant in VARIANTS]
MATRIX4 = [f"{loop}_plain" for loop in ["ddp", *IMPL_STAGES]]
PARITY_CASES = [(s, v, 2) for s in IMPL_STAGES for v in VARIANTS] + [(s, "plain", 4) for s in IMPL_STAGES]
FP32_SCENARIOS = [f"{loop}_fp32" for loop in ["ddp", *IMPL_STAGES]] + ["ddp_fp32-ulp-up", "ddp_fp32-ulp-down",
                                                                      "fairscale2_fp32-wrong_zero_grad"]


# Three jobs: the parity matrix at each world size, and the checkpoint, precision and memory-summary runs, whose
# tests wait only for their own job.
@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    """2 ranks: the 64-true matrix, the trap, the fp32 pairing and its floor."""
    out = tmp_path_factory.mktemp("zero2")
    return out, run_job(_scenario_any, 2, out, ["memory", *MATRIX, "fairscale2_wrong_zero_grad", *FP32_SCENARIOS],
                        PRELOAD)


@pytest.fixture(scope="module")
def job2_state(tmp_path_factory):
    """2 ranks: checkpoints and resume (64-true), 16-mixed, DCP, the summary's bytes."""
    out = tmp_path_factory.mktemp("zero2state")
    scenarios = ["ddp_half", *[f"{s}_half" for s in IMPL_STAGES], *[f"{s}_resumed" for s in IMPL_STAGES],
                 "torch2_from-ddp", "ddp_16-mixed", "torch3_16-mixed", "fairscale1_16-mixed", "sharded_checkpoint",
                 "torch3_summary"]
    return out, run_job(_scenario_any, 2, out, scenarios, PRELOAD)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero4")
    return out, run_job(_scenario_any, 4, out, ["memory", *MATRIX4], PRELOAD)


def weights(out: Path, scenario: str, name: str = "last.pt") -> dict:
    return load_model_state(out / scenario / "run", name)


def jobs(world_size, job2, job4):
    return {2: job2, 4: job4}[world_size]


# ---------------------------------------------------------------------- parity with DDP
@pytest.mark.slow
@pytest.mark.parametrize("impl_stage,variant,world_size", PARITY_CASES)
def test_every_cpu_capable_impl_and_stage_equals_ddp(impl_stage, variant, world_size, job2, job4):
    """64-true, two epochs (one at 4 ranks): within 1e-9 of DDP (measured 0.0 to 5.6e-17: FSDP2, OSS and ZeroRedundancyOptimizer
    step the same float64 AdamW on the same all-reduced or reduce-scattered gradients)."""
    out, results = jobs(world_size, job2, job4)
    ours_w = weights(out, f"{impl_stage}_{variant}")
    diff = max_param_diff(ours_w, weights(out, f"ddp_{variant}"))
    assert diff <= PARITY_TOL_64, f"{impl_stage} {variant} at {world_size} ranks vs DDP: max abs diff {diff:.3g}"
    assert all(v.dtype == torch.float64 for v in ours_w.values())  # the run really was 64-true
    for r in results:  # every rank took the same steps, with the same global batch, and saw the same val loss
        ours, theirs = r[f"{impl_stage}_{variant}"], r[f"ddp_{variant}"]
        assert ours["optimizer_steps"] == theirs["optimizer_steps"] == STEPS // PARITY_EPOCHS * EPOCHS_AT[world_size]
        assert ours["global_batch_size"] == GLOBAL_BATCH
        assert ours["final_val_loss"] == pytest.approx(theirs["final_val_loss"], rel=1e-9)


def test_clipping_really_clipped(job2):
    """The clip variant must differ from the plain one, else --grad-clip 0.05 never bit and the clip parity above
    proves nothing about clipping over shards."""
    out, _ = job2
    assert max_param_diff(weights(out, "ddp_clip"), weights(out, "ddp_plain")) > 1e-4  # measured 1.0e-2


def _fp32_floor(out: Path) -> float:
    """DDP's own fp32 drift (mlp, two epochs, 2 ranks) when its initial weights move one ulp up or down: the size
    rounding reaches over this horizon on this machine. Measured here 1.3e-6 (AdamW divides small gradients by
    their running RMS, which amplifies a one-ulp change more than SGD does)."""
    reference = weights(out, "ddp_fp32")
    drifts = [max_param_diff(weights(out, f"ddp_fp32-ulp-{d}"), reference) for d in ("up", "down")]
    assert min(drifts) > 0, "a one-ulp change made no difference: the floor measures nothing"
    return max(drifts)


@pytest.mark.parametrize("impl_stage", IMPL_STAGES)
def test_fp32_each_impl_and_stage_within_the_noise_floor_of_ddp(impl_stage, job2):
    """fp32 (mlp, 2 ranks, plain, two epochs): within 10 noise floors of DDP (measured 0.0: bitwise here)."""
    out, _ = job2
    diff = max_param_diff(weights(out, f"{impl_stage}_fp32"), weights(out, "ddp_fp32"))
    assert_within_fp32_floor(diff, _fp32_floor(out), f"{impl_stage} vs DDP (2 ranks)")


# ---------------------------------------------------------------------- the zero_grad trap
def test_sharded_ddp_zeroed_with_optimizer_zero_grad_diverges_and_the_loops_zeroing_does_not(job2):
    """ShardedDDP with its default reduce_buffer_size (2**23 elements: this model's every gradient is a view into a
    bucket). optimizer.zero_grad() sets .grad to None, so backward writes fresh tensors while the stale buckets are
    reduced: no error, wrong weights. sharded.zero_grad() (ShardedDDP's own) keeps the views: equal to DDP. Both
    checks catch it: 64-true and the fp32 noise-floor bound (mlp both)."""
    out, _ = job2
    ddp_weights = weights(out, "ddp_plain")
    wrong = max_param_diff(weights(out, "fairscale2_wrong_zero_grad"), ddp_weights)
    right = max_param_diff(weights(out, "fairscale2_plain"), ddp_weights)
    assert wrong > 1e6 * PARITY_TOL_64, f"the trap did not diverge ({wrong:.3g}): is the default reduce buffer used?"
    assert right <= PARITY_TOL_64  # the trap measured 1.9e-2 after 24 steps; the loop's zeroing 0.0
    wrong32 = max_param_diff(weights(out, "fairscale2_fp32-wrong_zero_grad"), weights(out, "ddp_fp32"))
    with pytest.raises(AssertionError):  # measured 1.9e-2: 1.4e4 floors
        assert_within_fp32_floor(wrong32, _fp32_floor(out), "the trap vs DDP (fp32)")


# ---------------------------------------------------------------------- checkpoints and resume
def _optimizer_diff(a: dict, b: dict) -> float:
    """Max abs difference of two torch.optim state dicts in the same (plain) layout."""
    assert a["param_groups"] == b["param_groups"], "the same hyper-parameters and parameter indices"
    assert a["state"].keys() == b["state"].keys()
    return max((a["state"][i][k].double() - b["state"][i][k].double()).abs().max().item()
               for i in a["state"] for k in a["state"][i])


@pytest.mark.parametrize("impl_stage", IMPL_STAGES)
def test_checkpoint_holds_ddps_full_model_and_optimizer_state(impl_stage, job2_state):
    """64-true, stopped 2 steps into epoch 2 (step 14): the gathered model and the consolidated optimizer state
    equal DDP's last.pt at step 14, float64, within 1e-9."""
    out, _ = job2_state
    ours = torch.load(out / f"{impl_stage}_half" / "run" / "last.pt", weights_only=True)
    theirs = torch.load(out / "ddp_half" / "run" / "last.pt", weights_only=True)
    assert ours["model"].keys() == theirs["model"].keys()  # no wrapper prefixes
    assert all(v.dtype == torch.float64 and not type(v).__name__ == "DTensor" for v in ours["model"].values())
    assert max_param_diff(ours["model"], theirs["model"]) <= PARITY_TOL_64
    assert _optimizer_diff(ours["optimizer"], theirs["optimizer"]) <= PARITY_TOL_64
    assert ours["step"] == theirs["step"] == HALF_STEPS


@pytest.mark.parametrize("impl_stage", IMPL_STAGES)
def test_resume_into_each_impl_and_stage_ends_where_the_uninterrupted_run_did(impl_stage, job2, job2_state):
    """14 steps, then resumed mid-epoch to the end of epoch 2 == the 24 steps of the plain run (64-true)."""
    out, results = job2_state
    resumed = weights(out, f"{impl_stage}_resumed")
    assert max_param_diff(resumed, weights(job2[0], f"{impl_stage}_plain")) <= PARITY_TOL_64
    assert all(r[f"{impl_stage}_resumed"]["optimizer_steps"] == STEPS for r in results)


def test_the_zero_loop_resumes_a_ddp_checkpoint(job2, job2_state):
    out, _ = job2_state
    assert max_param_diff(weights(out, "torch2_from-ddp"), weights(job2[0], "ddp_plain")) <= PARITY_TOL_64


def test_launch_single_resumes_a_zero_checkpoint(job2, job2_state, tmp_path):
    """launch/single.py --resume Z/last.pt (FSDP2 stage 3, 2 ranks x 64, 14 steps) with batch 128 to the end of
    epoch 2: DDP's weights within 1e-9 (64-true)."""
    ckpt = job2_state[0] / "torch3_half" / "run" / "last.pt"
    argv = ["--model", "mlp", "--batch-size", str(GLOBAL_BATCH), "--optimizer", "adamw", "--lr", "1e-3", "--schedule", "constant",
            "--epochs", str(PARITY_EPOCHS), "--precision", "64-true", "--resume", str(ckpt), "--out-dir",
            str(tmp_path / "single"), "--no-progress"]
    assert run(single.train, script="single", argv=argv) == 0  # what `python launch/single.py ...` runs
    assert max_param_diff(load_model_state(tmp_path / "single"), weights(job2[0], "ddp_plain")) <= PARITY_TOL_64


def test_sharded_dcp_checkpoint_round_trips_fsdp2_shards(job2_state):
    _, results = job2_state
    for r in results:
        assert r["sharded_checkpoint"]["params_diff"] == 0.0 and r["sharded_checkpoint"]["state_diff"] == 0.0
    assert ".metadata" in results[0]["sharded_checkpoint"]["files"]  # DCP's folder of per-rank shards


# ---------------------------------------------------------------------- memory per rank
def _memory(results: list[dict]) -> list[dict]:
    return [r["memory"] for r in results]


def _largest_tensor_bytes() -> int:
    """The bound on OSS's and ZeroRedundancyOptimizer's imbalance: they never split a tensor (fp32 cnn)."""
    from manual_train.data import DataInfo
    from manual_train.models import build_model

    return max(p.numel() for p in build_model("cnn", DataInfo("digits", (1, 8, 8), 10)).parameters()) * 4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("impl_stage", IMPL_STAGES)
def test_optimizer_state_per_rank_is_ddps_divided_by_n(impl_stage, world_size, job2, job4):
    """OSS and ZeroRedundancyOptimizer shard whole tensors: at most DDP/N + the largest tensor's state (2 x 4 bytes
    per element for AdamW). FSDP2 splits every tensor by rows: within 1% of DDP/N on every rank."""
    _, results = jobs(world_size, job2, job4)
    memory = _memory(results)
    ddp_state = memory[0]["ddp0"]["optimizer_state"]
    assert all(m["ddp0"]["optimizer_state"] == ddp_state for m in memory)
    per_rank = [m[impl_stage]["optimizer_state"] for m in memory]
    if impl_stage in ("torch2", "torch3"):
        assert all(abs(b - ddp_state / world_size) <= 0.01 * ddp_state / world_size for b in per_rank), per_rank
    else:
        assert all(b <= ddp_state / world_size + 2 * _largest_tensor_bytes() for b in per_rank), per_rank
    assert sum(per_rank) == pytest.approx(ddp_state, rel=1e-3)  # nothing lost, nothing duplicated (step counters)
    # The wrong variant: DDP itself is far from the bound
    assert ddp_state > ddp_state / world_size + 2 * _largest_tensor_bytes()


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage_3_shards_parameters_and_gradients_too(world_size, job2, job4):
    _, results = jobs(world_size, job2, job4)
    for m in _memory(results):
        ddp_row, row = m["ddp0"], m["torch3"]
        for kind in ("params", "grads"):  # FSDP2's row shards are padded to equal size: within 1% of 1/N
            assert abs(row[kind] - ddp_row[kind] / world_size) <= 0.01 * ddp_row[kind] / world_size, (kind, row)
        # between forward and backward stage 3 holds only the shards (each block is gathered again in backward) ...
        assert row["params_after_forward"] == row["params"]
        # ... stage 2 (SHARD_GRAD_OP) keeps the gathered parameters from forward to backward: shards + a full copy
        # (gathered from the padded shards: up to a row per tensor more)
        gathered = m["torch2"]["params_after_forward"] - m["torch2"]["params"]
        assert ddp_row["params"] <= gathered <= 1.01 * ddp_row["params"]
        assert m["torch2"]["params"] == row["params"]  # and reshards after backward, as stage 3


@pytest.mark.parametrize("world_size", [2, 4])
def test_stages_1_and_2_keep_full_parameters_and_fairscale_buffers_keep_full_gradients(world_size, job2, job4):
    """Stage 1 keeps DDP's parameters and gradients. ShardedDDP's default reduce buffers hold every gradient of a
    model this small on every rank (docs/zero.md); reduce_buffer_size=0 shards them (whole tensors)."""
    _, results = jobs(world_size, job2, job4)
    for m in _memory(results):
        ddp_row = m["ddp0"]
        for impl_stage in ("torch1", "fairscale1", "fairscale2"):
            assert m[impl_stage]["params"] == ddp_row["params"]
        assert m["torch1"]["grads"] == m["fairscale1"]["grads"] == m["fairscale2"]["grads"] == ddp_row["grads"]
        sharded = m["fairscale-buffer02"]["grads"]
        assert sharded <= ddp_row["grads"] / world_size + _largest_tensor_bytes()


def test_summary_reports_the_same_accounting_as_measure_rank(job2, job2_state):
    """The loop's summary.json per_rank_bytes (fp32 cnn, after 6 steps) equals measure_rank's after one step: same
    shards."""
    summary = json.loads((job2_state[0] / "torch3_summary" / "run" / "summary.json").read_text())
    measured = [{k: m["torch3"][k] for k in ("params", "grads", "optimizer_state", "total")} for m in _memory(job2[1])]
    assert summary["per_rank_bytes"] == measured
    assert summary["zero_impl"] == "torch" and summary["zero_stage"] == 3 and summary["psi"] == 89930
    assert summary["zero_formula_bytes"]["optimizer_state"] == 89930 * 8 / 2  # fp32 AdamW: 8 bytes per parameter


def test_the_benchmarks_entry_point_measures_what_the_jobs_measured(job2):
    """measure_per_rank_bytes (the function the benchmark calls) starts its own 2 ranks (here from the forkserver the
    jobs warmed up) and returns, per (impl, stage), each rank's bytes and the formula: those of the 2-rank job."""
    result = measure_per_rank_bytes(2, start_method="forkserver")
    assert result["psi"] == 89930 and result["bytes_per_param"] == {"param_bytes": 4, "grad_bytes": 4, "state_bytes": 8}
    assert [(row["impl"], row["stage"]) for row in result["rows"]] == [("ddp", 0), *CPU_CAPABLE]
    memory = _memory(job2[1])
    for row in result["rows"]:
        key = f"{row['impl']}{row['stage']}"
        assert row["per_rank"] == [{k: v for k, v in m[key].items() if k not in ("impl", "stage")} for m in memory]
        # fp32 AdamW on 2 ranks: DDP 16 psi, stage 1 (4 + 4 + 8/2) psi, stage 2 (4 + 12/2) psi, stage 3 16/2 psi
        assert row["formula"]["total"] == pytest.approx({0: 16, 1: 12, 2: 10, 3: 8}[row["stage"]] * 89930)


# ---------------------------------------------------------------------- precision composes
@pytest.mark.slow
@pytest.mark.parametrize("impl_stage", ["torch3", "fairscale1"])
def test_16_mixed_composes_with_zero(impl_stage, job2_state):
    """FSDP2: parameters gathered in fp16, gradients reduce-scattered in fp32, ShardedGradScaler; fairscale stage 1:
    autocast + a plain GradScaler (DDP leaves full gradients everywhere). Both close to DDP in 16-mixed."""
    out, results = job2_state
    assert max_param_diff(weights(out, f"{impl_stage}_16-mixed"), weights(out, "ddp_16-mixed")) < 1e-4
    for r in results:
        assert r[f"{impl_stage}_16-mixed"]["skipped_steps"] == r["ddp_16-mixed"]["skipped_steps"]


# ---------------------------------------------------------------------- the CLI, under torchrun
@pytest.mark.slow
def test_torchrun_zero_cli_equals_torchrun_ddp_cli(job2, zero_torchrun_uninterrupted):
    """torchrun --nproc_per_node=2 launch/zero.py --stage 3 --impl torch --model mlp --optimizer adamw --lr 1e-3
    --schedule constant --batch-size 64 --epochs 2 --precision 64-true --checkpoint-format dcp --out-dir Z (conftest's
    zero_torchrun_uninterrupted, which tests/test_preemption.py resumes too) against the DDP loop with the same flags
    (job2's ddp_plain: ddp.train on DDPConfig, what launch/ddp.py calls): within 1e-9, Z's sharded last.dcp read
    whole. Stage 3 is the one that changes most; the in-process matrix covers the others."""
    out, results = job2
    z, proc = zero_torchrun_uninterrupted
    flags = " ".join(ZERO_TORCHRUN_FLAGS)
    assert f"--batch-size {GLOBAL_BATCH // 2} " in flags and f"--epochs {PARITY_EPOCHS} " in flags  # job2's run
    diff = max_param_diff(final_weights(z), weights(out, "ddp_plain"))
    assert diff <= PARITY_TOL_64, f"Z/last.dcp vs the DDP loop's last.pt: max abs diff {diff:.3g}"  # measured 0.0
    assert "global batch 128 = batch 64 x accumulate 1 x world size 2" in proc.stdout
    assert proc.stdout.count("bytes per rank (--impl torch --stage 3, 2 ranks") == 1  # rank 0 prints the table
    assert "ZeRO formula" in proc.stdout and "DDP formula" in proc.stdout
    summary = json.loads((z / "summary.json").read_text())
    assert summary["script"] == "zero" and len(summary["per_rank_bytes"]) == 2 and summary["optimizer_steps"] == STEPS
    assert summary["final_val_loss"] == pytest.approx(results[0]["ddp_plain"]["final_val_loss"], rel=1e-9)
