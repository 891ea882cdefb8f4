"""DDP's knobs and exact training on any dataset size (docs/ddp_knobs.md), in real gloo process groups.

Two jobs run scenarios in real processes (tests/jobs.py, as tests/test_ddp_parity.py does): 2 ranks for the knobs,
3 ranks for uneven shards; the single-process references run here. Each claim has a known-wrong variant that the
same assertion rejects.

What is proven here (docs/ddp_knobs.md cites these names):
  knobs ............. --bucket-cap-mb (tiny: 4 buckets, huge: 1), --gradient-as-bucket-view, --static-graph,
                      --find-unused-parameters through the DDP loop: the weights of plain DDP bit for bit (64-true,
                      30 steps), and each knob really reached DDP (its logging data); an fp16 hook is not bitwise
  bucket views ...... every .grad is a view into its bucket: gradients + buckets hold one copy, not two
  unused ........... a model with an unused branch fails without --find-unused-parameters, trains with it
  comm hooks ....... the counting hook's bytes == every tensor handed to torch.distributed.all_reduce; fp16/bf16
                      send half, PowerSGD (rank 1) ~1/50 once it starts; the weights deviate from exact DDP (lossy)
  PowerSGD on gloo .. refused in one line when the gradients span more than one bucket
  uneven shards ..... 3 ranks on 77 samples (and 19 for validation): the single process's weights (1e-9) and
                      validation numbers, with and without --accumulate, for DDP and ZeRO (FSDP2); a mid-epoch resume
                      ends where the uninterrupted run did; DistributedSampler's padding (pad=True) is far off;
                      an empty micro-batch gives exact zero gradients (every model)
  Join .............. torch's alternative: divide_by_initial_world_size=False gives the mean over the samples seen,
                      the default divisor does not, and the rank that ran out keeps its old momentum
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import assert_cross_path_64, PARITY_TOL_64, load_model_state, make_cfg, max_param_diff
from jobs import run_job

from manual_train import data
from manual_train.cli import run
from manual_train.config import Config, UsageError
from manual_train.loops import ddp, single
from manual_train.loops import zero as zero_loop
from manual_train.zero import ZeroConfig

KNOB_STEPS = 30  # 30 SGD steps, digits, 2 ranks x 16
KNOBS = {"plain": {}, "bucket_tiny": {"bucket_cap_mb": 0.01}, "bucket_huge": {"bucket_cap_mb": 1000},
         "views": {"gradient_as_bucket_view": True}, "static": {"static_graph": True},
         "unused": {"find_unused_parameters": True}, "fp16": {"comm_hook": "fp16"}, "bf16": {"comm_hook": "bf16"},
         "powersgd": {"comm_hook": "powersgd", "powersgd_start": 10}}
EXACT = ("bucket_tiny", "bucket_huge", "views", "static", "unused")
# Uneven: 77 = 3 x 25 + 2 samples on 3 ranks of 5 per micro-batch: shards of 26/26/25, so rank 2's 6th micro-batch
# is empty; the epoch's last global micro-batch holds 2 samples (fewer than the ranks); validation 19 = 7/6/6.
UNEVEN = dict(dataset="synthetic", synthetic_size=77, synthetic_shape="1,8,8", synthetic_classes=10, model="cnn",
              epochs=2, lr=0.1, precision="64-true", log_every=2)
UNEVEN_RANKS, UNEVEN_BATCH = 3, 5


# ---------------------------------------------------------------------- the scenarios, run inside each rank
class _RecordingDDP(torch.nn.parallel.DistributedDataParallel):
    """The loop's DDP, keeping each instance (test-only: to read what DDP was given)."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingDDP.made.append(self)


def _knob_scenario(name: str, out: Path) -> dict:
    cfg = make_cfg(out, ddp.DDPConfig, batch_size=16, max_steps=KNOB_STEPS, precision="64-true", dist_timeout_s=120,
                   log_every=10, **KNOBS[name])
    real_ddp, _RecordingDDP.made = ddp.DDP, []
    ddp.DDP = _RecordingDDP
    try:
        summary = ddp.train(cfg)
    finally:
        ddp.DDP = real_ddp
    logged = _RecordingDDP.made[0]._get_ddp_logging_data()
    return {"steps": summary["optimizer_steps"],
            **{k: logged.get(k) for k in ("bucket_cap_bytes", "gradient_as_bucket_view", "static_graph",
                                         "find_unused_parameters", "num_buckets_reduced", "comm_hook")}}


def _bare_ddp(model, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, **kwargs)


def _batch(rank: int, step: int, b: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(b, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (b,), generator=g)


def _hooks_scenario(rank: int) -> dict:
    """Each --comm-hook's counted bytes against every tensor handed to torch.distributed.all_reduce, 12 steps."""
    import torch.distributed as dist

    from manual_train.distributed import DDPConfig, comm_hook
    from manual_train.models import build_model, loss_fn

    real_all_reduce, results = dist.all_reduce, {}
    for kind in ("none", "fp16", "bf16", "powersgd"):
        torch.manual_seed(0)
        model = build_model("cnn", data.DataInfo("digits", (1, 8, 8), 10))  # fp32: 359,720 bytes of gradients
        wrapped = _bare_ddp(model)
        state, hook = comm_hook(DDPConfig(comm_hook=kind, powersgd_start=4 if kind == "powersgd" else None), wrapped)
        wrapped.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = [0]

        def counting_all_reduce(tensor, *args, **kwargs):
            seen[0] += tensor.numel() * tensor.element_size()
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce  # module attribute: the hooks look it up at every call
        try:
            per_step = []
            for step in range(12):
                x, y = _batch(rank, step)
                optimizer.zero_grad()
                before = state.bytes
                loss_fn(wrapped(x.float()), y).backward()
                optimizer.step()
                per_step.append(state.bytes - before)
        finally:
            dist.all_reduce = real_all_reduce
        results[kind] = {"counted": state.bytes, "seen": seen[0], "syncs": state.syncs, "per_step": per_step,
                         "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}
    return results


def _views_scenario(rank: int) -> dict:
    from manual_train.bench.ddp_knobs import gradient_bytes
    from manual_train.models import build_model

    out = {}
    for views in (False, True):
        torch.manual_seed(0)
        model = build_model("cnn", data.DataInfo("digits", (1, 8, 8), 10)).double()
        out[str(views)] = gradient_bytes(model, views, steps=3, batch=lambda step: _batch(rank, step))
    return out


class _TwoBranches(torch.nn.Module):
    """A model whose second branch forward never uses: DDP waits for its gradients unless told to look."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(64, 10), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.used(x.flatten(1))


def _unused_scenario(rank: int) -> dict:
    out = {}
    for find in (False, True):
        torch.manual_seed(0)
        model = _bare_ddp(_TwoBranches().double(), find_unused_parameters=find)
        try:
            for step in range(2):  # the second forward finds the first step's reduction unfinished
                x, y = _batch(rank, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            out[str(find)] = "trained"
        except RuntimeError as e:
            out[str(find)] = str(e).splitlines()[0]
    return out


def _powersgd_refused(out: Path) -> dict:
    cfg = make_cfg(out, ddp.DDPConfig, max_steps=2, comm_hook="powersgd", bucket_cap_mb=0.05, dist_timeout_s=60)
    try:
        ddp.train(cfg)
    except UsageError as e:
        return {"error": str(e)}
    return {"error": None}


def _join_scenario(rank: int) -> dict:
    """torch's Join: rank 0 has 7 batches, rank 1 has 5 (float64 linear model, plain SGD, and SGD with momentum)."""
    from torch.distributed.algorithms.join import Join

    out = {}
    for name, divide_by_initial, momentum in (("exact", False, 0.0), ("default", True, 0.0), ("momentum", False, 0.9)):
        torch.manual_seed(0)
        raw = torch.nn.Linear(64, 10).double()
        model = _bare_ddp(raw)
        optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=momentum)
        with Join([model], divide_by_initial_world_size=divide_by_initial):
            for step in range(7 if rank == 0 else 5):
                x, y = _batch(rank, step)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x.flatten(1)), y).backward()
                optimizer.step()
        buffers = [optimizer.state[p].get("momentum_buffer") for p in raw.parameters()]
        out[name] = {"weights": torch.cat([p.detach().reshape(-1) for p in raw.parameters()]).tolist(),
                     "momentum": torch.cat([b.reshape(-1) for b in buffers]).tolist() if momentum else []}
    return out


def _bench_scenario(rank: int) -> dict:
    """The benchmark entry's measurements (manual_train/bench/ddp_knobs.py, measure_rank), shrunk to seconds."""
    from manual_train.bench.ddp_knobs import measure_rank

    return measure_rank(width=64, depth=4, steps=1, repeats=1)


def _padded_train_sampler(dataset, seed, world_size=1, rank=0, pad=True):
    return data.TrainSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)


def _uneven_scenario(name: str, out: Path) -> dict:
    flags = dict(UNEVEN, batch_size=UNEVEN_BATCH, dist_timeout_s=120)
    if name.endswith("accumulate"):
        flags.update(accumulate=2)
    if name.startswith("const"):  # a constant schedule, so a run cut by --max-steps has the same LR at each step
        flags.update(schedule="constant")
        if name == "const_half":  # stopped 3 steps into epoch 2 (6 steps an epoch): last.pt mid-epoch
            flags.update(max_steps=9)
        if name == "const_resumed":  # rank 2's shard, resumed at its 15th sample, ends in its empty micro-batch
            flags.update(resume=str(out.parent / "const_half" / "run" / "last.pt"))
    if name.startswith("zero"):  # "zero2_uneven": FSDP2, which runs every rank's empty micro-batch as a collective
        summary = zero_loop.train(make_cfg(out, ZeroConfig, stage=int(name[4]), **flags))
    elif name == "padded":  # the known-wrong variant: DistributedSampler's repeats
        real = ddp.data.train_sampler
        ddp.data.train_sampler = _padded_train_sampler
        try:
            summary = ddp.train(make_cfg(out, ddp.DDPConfig, **flags))
        finally:
            ddp.data.train_sampler = real
    else:
        summary = ddp.train(make_cfg(out, ddp.DDPConfig, **flags))
    return {k: summary[k] for k in ("final_val_loss", "final_val_acc", "optimizer_steps", "samples_seen")}


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    if name in KNOBS:
        return _knob_scenario(name, out / name)
    if name in ("hook_bytes", "bucket_views", "unused_branch", "join", "bench_rows"):
        from manual_train.distributed import read_env, setup, teardown

        setup(read_env(), torch.device("cpu"), "gloo", 120)
        try:
            return {"hook_bytes": _hooks_scenario, "bucket_views": _views_scenario, "unused_branch": _unused_scenario,
                    "join": _join_scenario, "bench_rows": _bench_scenario}[name](rank)
        finally:
            teardown()
    if name == "powersgd_refused":
        return _powersgd_refused(out / name)
    return _uneven_scenario(name, out / name)


PRELOAD = ["manual_train.loops.ddp", "manual_train.loops.zero", "manual_train.bench.ddp_knobs"]


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    out = tmp_path_factory.mktemp("knobs2")
    return out, run_job(_scenario, 2, out, [*KNOBS, "hook_bytes", "bucket_views", "unused_branch",
                                            "powersgd_refused", "join", "bench_rows"], PRELOAD)


@pytest.fixture(scope="module")
def job3(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven3")
    return out, run_job(_scenario, UNEVEN_RANKS, out, ["uneven", "uneven_accumulate", "padded", "zero2_uneven",
                                                       "zero3_uneven_accumulate", "const", "const_half",
                                                       "const_resumed"], PRELOAD)


# ---------------------------------------------------------------------- the knobs
@pytest.mark.slow
def test_exact_knobs_give_plain_ddps_weights(job2):
    out, results = job2
    plain = load_model_state(out / "plain" / "run")
    for name in EXACT:
        assert_cross_path_64(load_model_state(out / name / "run"), plain, f"{name} vs plain DDP")
    # ... and each knob reached DDP (its own logging data), with the effect it should have
    logged = {name: results[0][name] for name in KNOBS}
    assert all(r["steps"] == KNOB_STEPS for r in logged.values())
    # float64 cnn: 719,440 bytes of gradients, one bucket by default, 5 at 0.01 MiB (one tensor or two each)
    assert logged["plain"]["num_buckets_reduced"] == 1 and logged["bucket_tiny"]["num_buckets_reduced"] == 5
    assert logged["bucket_tiny"]["bucket_cap_bytes"] == int(0.01 * 2 ** 20)
    assert logged["bucket_huge"]["bucket_cap_bytes"] == 1000 * 2 ** 20
    assert logged["views"]["gradient_as_bucket_view"] == 1 and logged["plain"]["gradient_as_bucket_view"] == 0
    assert logged["static"]["static_graph"] == 1 and logged["unused"]["find_unused_parameters"] == 1
    # the wrong variant: a lossy hook is not bitwise (nor, below, within 1e-9)
    assert max_param_diff(load_model_state(out / "fp16" / "run"), plain) > PARITY_TOL_64


def test_bucket_views_hold_one_copy_of_the_gradients(job2):
    _, results = job2
    for r in results:
        plain, views = r["bucket_views"]["False"], r["bucket_views"]["True"]
        grad_bytes = plain["param_bytes"]  # float64 cnn: 719,440 bytes
        assert views["grads_in_buckets"] and not plain["grads_in_buckets"]
        # after backward and after the step: .grad and the buckets, each storage once
        assert plain["after_backward"] == plain["after_step"] == 2 * grad_bytes
        assert views["after_backward"] == views["after_step"] == grad_bytes
        # zero_grad(set_to_none=True) frees plain DDP's .grad; the buckets stay in both
        assert plain["after_zero_grad"] == views["after_zero_grad"] == grad_bytes


def test_an_unused_parameter_needs_find_unused_parameters(job2):
    _, results = job2
    for r in results:
        assert r["unused_branch"]["False"].startswith("Expected to have finished reduction in the prior iteration")
        assert r["unused_branch"]["True"] == "trained"


def test_the_benchmark_entry_builds_its_rows(job2, tmp_path):
    """manual_train/bench/ddp_knobs.py's entry on the measurements of the job's ranks (a shrunk MLP): the memory
    rows say one copy less, the byte rows say half for fp16/bf16 and less for PowerSGD."""
    from manual_train.bench.ddp_knobs import ddp_knobs, deep_mlp
    from manual_train.bench.harness import Bench

    _, results = job2
    raw = {"world_size": 2, "width": 64, "depth": 4, "params": sum(p.numel() for p in deep_mlp(64, 4).parameters()),
           "ranks": [r["bench_rows"] for r in results]}

    class Measured(Bench):
        def child(self, fn, **kwargs):
            return raw

    outcome = ddp_knobs(Measured(suite="cpu", quick=True, threads=1, log_dir=tmp_path, entry="ddp_knobs"))
    medians = {(row.variant, row.metric.split(" (")[0]): row.median for row in outcome.rows}
    assert medians[("gradient_as_bucket_view", "gradient bytes held after_backward")] == 0.5
    assert medians[("gradient_as_bucket_view", "gradient bytes held after_zero_grad")] == 1.0
    assert medians[("--comm-hook fp16", "bytes all-reduced per step per rank")] == 0.5
    assert medians[("--comm-hook powersgd", "bytes all-reduced per step per rank")] < 0.5
    assert all(math.isfinite(row.median) and row.median >= 0 for row in outcome.rows)


# ---------------------------------------------------------------------- communication hooks
def test_comm_hooks_bytes_are_what_all_reduce_was_handed(job2):
    out, results = job2
    grad_bytes = 359_720  # the fp32 cnn's 89,930 gradients
    for r in results:
        hooks = r["hook_bytes"]
        for kind, h in hooks.items():
            assert h["counted"] == h["seen"], kind  # the wrapping hook counts what really went to all-reduce
            assert h["syncs"] == 12
        assert hooks["none"]["per_step"] == [grad_bytes] * 12
        assert hooks["fp16"]["per_step"] == hooks["bf16"]["per_step"] == [grad_bytes // 2] * 12
        powersgd = hooks["powersgd"]["per_step"]
        assert powersgd[:4] == [grad_bytes] * 4  # --powersgd-start 4: exact all-reduces first
        assert all(step == powersgd[4] and step < grad_bytes / 40 for step in powersgd[4:])
        # The known-wrong count: the bucket's own bytes (what DDP's built-in all-reduce sends) for a 16-bit hook.
        assert hooks["fp16"]["seen"] != 12 * grad_bytes
        # Lossy: the weights move away from the exact hook's; equal on both ranks (DDP's invariant holds).
        exact = torch.tensor(hooks["none"]["weights"])
        for kind in ("fp16", "bf16", "powersgd"):
            assert (torch.tensor(hooks[kind]["weights"]) - exact).abs().max() > 1e-7, kind
    for kind in ("none", "fp16", "bf16", "powersgd"):
        assert results[0]["hook_bytes"][kind]["weights"] == results[1]["hook_bytes"][kind]["weights"]


@pytest.mark.slow
def test_compressing_hooks_are_lossy_through_the_loop(job2):
    out, results = job2
    plain = load_model_state(out / "plain" / "run")
    deviation = {kind: max_param_diff(load_model_state(out / kind / "run"), plain) for kind in ("fp16", "bf16",
                                                                                               "powersgd")}
    print(f"max abs weight deviation from exact DDP after {KNOB_STEPS} steps (64-true): {deviation}")
    assert all(1e-9 < d < 0.2 for d in deviation.values()), deviation
    assert results[0]["fp16"]["comm_hook"] == "counting_hook"


def test_powersgd_is_refused_on_gloo_when_gradients_span_buckets(job2):
    _, results = job2
    for r in results:
        assert r["powersgd_refused"]["error"].startswith(
            "--comm-hook: powersgd on gloo fails (hangs or 'collective mismatch') when the gradients span more than "
            "one bucket: these 0.34 MiB make ")
        assert "(allowed: --bucket-cap-mb 1 or more" in r["powersgd_refused"]["error"]


# ---------------------------------------------------------------------- exact training on any dataset size
def _single_uneven(out: Path, accumulate: int = 1) -> Path:
    single.train(make_cfg(out, Config, **UNEVEN, batch_size=UNEVEN_RANKS * UNEVEN_BATCH, accumulate=accumulate))
    return out / "run"


@pytest.fixture(scope="module")
def single_uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("single_uneven")
    return {k: _single_uneven(root / f"k{k}", k) for k in (1, 2)}


def test_uneven_shards_sampler_has_holes_not_repeats():
    ds = torch.utils.data.TensorDataset(torch.arange(77))
    shards = [list(data.train_sampler(ds, 0, 3, r, pad=False)) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(77))  # each sample once
    assert [len(s) for s in shards] == [26, 26, 25]
    padded = [list(data.train_sampler(ds, 0, 3, r)) for r in range(3)]
    assert sum(map(len, padded)) == 78  # DistributedSampler's rule: one repeat
    loaders = [data.build_loader(ds, Config(), torch.device("cpu"), batch_size=5,
                                 sampler=data.train_sampler(ds, 0, 3, r, pad=False)) for r in range(3)]
    assert [[len(b[0]) for b in loader] for loader in loaders] == [[5] * 5 + [1], [5] * 5 + [1], [5] * 5 + [0]]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["uneven", "uneven_accumulate", "zero2_uneven", "zero3_uneven_accumulate"])
def test_uneven_shards_train_the_single_process_weights(scenario, job3, single_uneven):
    out, results = job3
    reference = single_uneven[2 if scenario.endswith("accumulate") else 1]
    diff = max_param_diff(load_model_state(out / scenario / "run"), load_model_state(reference))
    print(f"3 ranks on 77 samples ({scenario}) vs one process: max abs weight diff {diff:.3g}")
    assert diff <= PARITY_TOL_64, f"3 ranks on 77 samples ({scenario}) vs one process: {diff:.3g}"
    summary = json.loads((reference / "summary.json").read_text())
    for r in results:
        assert r[scenario]["samples_seen"] == summary["samples_seen"] == 2 * 77
        assert r[scenario]["optimizer_steps"] == summary["optimizer_steps"]
        assert r[scenario]["final_val_acc"] == summary["final_val_acc"]  # 19 samples, shards 7/6/6
        assert r[scenario]["final_val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-12, abs=0)


def test_padding_with_repeats_is_not_the_single_process_run(job3, single_uneven):
    out, _ = job3
    diff = max_param_diff(load_model_state(out / "padded" / "run"), load_model_state(single_uneven[1]))
    print(f"DistributedSampler's repeats vs one process: {diff:.3g}")
    assert diff > 1e-4, f"DistributedSampler's repeats: {diff:.3g}"


def test_a_mid_epoch_resume_on_uneven_shards_ends_where_the_uninterrupted_run_did(job3):
    out, results = job3
    diff = max_param_diff(load_model_state(out / "const_resumed" / "run"), load_model_state(out / "const" / "run"))
    assert diff <= PARITY_TOL_64, f"resumed after 9 of 12 steps vs uninterrupted: {diff:.3g}"
    assert all(r["const_resumed"]["optimizer_steps"] == r["const"]["optimizer_steps"] == 12 for r in results)
    assert all(r["const_resumed"]["samples_seen"] == 2 * 77 for r in results)


def test_join_divides_by_the_ranks_still_training_only_when_told(job2):
    """torch's Join, the alternative to the loop's empty micro-batches: rank 0 trains 7 steps, rank 1 runs out
    after 5. With divide_by_initial_world_size=False steps 6 and 7 take rank 0's gradient alone (the mean over the
    samples seen); with the default divisor they take half of it. Weights end equal on both ranks either way
    (Join broadcasts them), but the optimizer's momentum of the rank that ran out stops at step 5."""
    _, results = job2
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 10).double()
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(7):
        xs, ys = zip(*[_batch(rank, step) for rank in ((0, 1) if step < 5 else (0,))])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs).flatten(1)), torch.cat(ys)).backward()
        optimizer.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for r in results:
        exact, default = (torch.tensor(r["join"][k]["weights"], dtype=torch.float64) for k in ("exact", "default"))
        assert (exact - expected).abs().max() <= PARITY_TOL_64
        assert (default - expected).abs().max() > 1e-3
    assert results[0]["join"]["momentum"]["weights"] == results[1]["join"]["momentum"]["weights"]
    momentum_gap = (torch.tensor(results[0]["join"]["momentum"]["momentum"]) -
                    torch.tensor(results[1]["join"]["momentum"]["momentum"])).abs().max()
    gaps = [(torch.tensor(r["join"][k]["weights"], dtype=torch.float64) - expected).abs().max().item()
            for r in results[:1] for k in ("exact", "default")]
    print(f"Join vs the samples seen: divide_by_initial_world_size=False {gaps[0]:.3g}, default {gaps[1]:.3g}; "
          f"momentum gap between the ranks {momentum_gap:.3g}")
    assert momentum_gap > 1e-3


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "seq2seq"])
def test_an_empty_micro_batch_gives_zero_gradients_and_leaves_batchnorm_alone(name):
    """What the rank past its shard's end relies on: forward and backward run on 0 samples, every gradient is
    exactly 0 (its all-reduce adds nothing), running statistics do not move; only the mean loss is 0/0."""
    from manual_train.models import build_model, correct_count, loss_fn

    shape, classes = {"resnet18": ((3, 32, 32), 10), "seq2seq": ((2, 8), 11)}.get(name, ((1, 8, 8), 10))
    torch.manual_seed(0)
    model = build_model(name, data.DataInfo("reverse" if name == "seq2seq" else "synthetic", shape, classes)).double()
    x = torch.zeros(0, *shape, dtype=torch.long) if name == "seq2seq" else torch.zeros(0, *shape, dtype=torch.float64)
    y = torch.zeros(0, *((8,) if name == "seq2seq" else ()), dtype=torch.long)
    stats = {k: v.clone() for k, v in model.named_buffers() if "running" in k}
    logits = model(x)
    loss = loss_fn(logits, y)
    (loss * 0.0).backward()  # the loop's weight for it: 0 samples / the window's
    assert torch.isnan(loss) and correct_count(logits, y) == 0
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    assert all(torch.equal(v, stats[k]) for k, v in model.named_buffers() if k in stats)
    # the wrong variant: the same backward on one real sample gives gradients
    model.zero_grad()
    loss_fn(model(torch.cat([x, x.new_ones(1, *shape)])), torch.cat([y, y.new_zeros(1, *y.shape[1:])])).backward()
    assert any(torch.count_nonzero(p.grad) for p in model.parameters())


# ---------------------------------------------------------------------- the flags
def test_knob_flags_are_refused_by_the_zero_loop_and_powersgd_flags_need_the_hook():
    with pytest.raises(UsageError, match="^--static-graph: is a knob of the DDP loop's DistributedDataParallel"):
        make_cfg(Path("/tmp/unused"), ZeroConfig, static_graph=True)
    with pytest.raises(UsageError, match="^--powersgd-rank: is PowerSGD's; this run uses --comm-hook fp16"):
        make_cfg(Path("/tmp/unused"), ddp.DDPConfig, comm_hook="fp16", powersgd_rank=2)
    assert run(ddp.train, ddp.DDPConfig, script="ddp", argv=["--bucket-cap-mb", "0"]) == 2
