"""DDP's knobs, measured (docs/ddp_knobs.md): gradient memory, bytes sent per step, step time.

    gradient_bytes(model, views, steps, batch)   in a running group: the gradient storage this rank holds (.grad
                                                 tensors and DDP's buckets, each storage once) at each point of a step
    measure_rank(cfg)                            in a running group: every row's numbers for this rank
    measure(world_size, ...)                     the benchmark's entry point: N gloo processes run measure_rank
    ddp_knobs(bench)                             the CPU suite's entry (manual_train/bench/cpu.py registers it)

Memory is counted in tensor bytes (storage sizes), not the process's RSS: glibc keeps freed memory, and the
question is how many copies of the gradients exist. Communication is counted in bytes by the loop's own counting
hook (manual_train/distributed.py, counting_hook), not in seconds: on a 2-core machine the ranks' all-reduce is a
memory copy between processes that share the cores, so no hook can show a speed-up here. Step times are reported
for what they are: the cost of DDP's bookkeeping (buckets, graph walks) on this CPU.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 2 ** 20
# The step-time model: an MLP of many equal layers, so that bucket caps change the number of buckets (a bucket
# holds at least one tensor); width 1024 and 16 hidden layers is 15.8 M parameters, 60 MiB of fp32 gradients.
BUCKET_CAPS = {"tiny": 0.01, "default": None, "huge": 1000.0}  # MiB; None: torch's 25 with a first bucket of 1


def deep_mlp(width: int, depth: int) -> torch.nn.Module:
    layers = [torch.nn.Flatten(), torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _batch(step: int, batch_size: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(batch_size, 1, 8, 8, generator=g, dtype=dtype), torch.randint(0, 10, (batch_size,), generator=g)


# ---------------------------------------------------------------------- gradient memory
def gradient_bytes(model: torch.nn.Module, views: bool, steps: int, batch, bucket_cap_mb=None) -> dict:
    """Wrap `model` in DDP (gradient_as_bucket_view=views), train `steps` SGD steps on batch(step) -> (x, y), and
    return the last step's gradient storage held by this rank (each storage once: a .grad that is a view into its
    bucket adds nothing) right after zero_grad(set_to_none=True), after backward and after optimizer.step, plus
    param_bytes and whether every .grad lives in a bucket. DDP's buckets are read through a comm hook
    (torch's allreduce_hook, what DDP does without one) that keeps a reference to each bucket's buffer."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from manual_train.memory import storage_bytes
    from manual_train.models import loss_fn

    buckets = {}

    def recording_hook(state, bucket):
        buckets[bucket.index()] = bucket.buffer()  # the bucket itself (a reference: no copy)
        return allreduce_hook(state, bucket)

    params = [p for p in model.parameters() if p.requires_grad]
    wrapped = DDP(model, gradient_as_bucket_view=views, bucket_cap_mb=bucket_cap_mb)
    wrapped.register_comm_hook(None, recording_hook)
    optimizer = torch.optim.SGD(params, lr=0.01)

    def held() -> int:
        return storage_bytes([p.grad for p in params] + list(buckets.values()))

    out = {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out["after_zero_grad"] = held()
        x, y = batch(step)
        loss_fn(wrapped(x), y).backward()
        out["after_backward"] = held()
        optimizer.step()
        out["after_step"] = held()
    bucket_storages = {b.untyped_storage().data_ptr() for b in buckets.values()}
    out["grads_in_buckets"] = all(p.grad.untyped_storage().data_ptr() in bucket_storages for p in params)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["buckets"] = len(buckets)
    return out


# ---------------------------------------------------------------------- bytes sent, and what they cost in accuracy
def hook_bytes_and_deviation(make_model, kinds=("none", "fp16", "bf16", "powersgd"), steps: int = 30,
                             powersgd_start: int = 10) -> dict:
    """For each --comm-hook: bytes this rank sent per step (the loop's counting_hook), before and after PowerSGD
    starts, and the largest weight difference from the exact hook's after `steps` SGD steps. One bucket for all
    (bucket_cap_mb 1000): PowerSGD on gloo needs it (distributed.check_powersgd)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from manual_train.distributed import DDPConfig, comm_hook
    from manual_train.models import loss_fn

    rows, exact = {}, None
    for kind in kinds:
        torch.manual_seed(0)
        model = make_model()
        wrapped = DDP(model, bucket_cap_mb=1000.0)
        cfg = DDPConfig(comm_hook=kind, bucket_cap_mb=1000.0, powersgd_start=powersgd_start if kind == "powersgd"
                        else None)
        state, hook = comm_hook(cfg, wrapped)
        wrapped.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        per_step = []
        for step in range(steps):
            x, y = _batch(step)
            optimizer.zero_grad(set_to_none=True)
            before = state.bytes
            loss_fn(wrapped(x), y).backward()
            optimizer.step()
            per_step.append(state.bytes - before)
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        exact = weights if kind == "none" else exact
        rows[kind] = {"bytes_per_step": per_step[-1], "bytes_first_step": per_step[0],
                      "deviation": float((weights - exact).abs().max()) if exact is not None else None}
    return rows


# ---------------------------------------------------------------------- step time
STEP_CONFIGS = {  # name -> DDP keyword arguments (the loop's flags)
    "default": {}, "bucket tiny": {"bucket_cap_mb": BUCKET_CAPS["tiny"]},
    "bucket huge": {"bucket_cap_mb": BUCKET_CAPS["huge"]}, "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True}, "find_unused_parameters": {"find_unused_parameters": True},
}


def step_seconds(make_model, ddp_kwargs: dict, steps: int, warmup: int = 2) -> float:
    """Median seconds per SGD step (forward, backward with its all-reduces, step) of DDP(make_model(), **kwargs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from manual_train.models import loss_fn

    torch.manual_seed(0)
    model = make_model()
    wrapped = DDP(model, **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(warmup + steps):
        x, y = _batch(step)
        dist.barrier()  # every rank starts the step together: the time is the group's
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:])


def small_cnn() -> torch.nn.Module:
    from manual_train.data import DataInfo
    from manual_train.models import build_model

    return build_model("cnn", DataInfo("digits", (1, 8, 8), 10))  # the demo's model: 10 tensors, 0.34 MiB


def measure_rank(width: int, depth: int, steps: int, repeats: int) -> dict:
    """Every row's numbers for this rank, in a running group. Step times for two models: the big MLP (the step's
    compute and its 60 MiB all-reduce dominate) and the demo's small CNN (DDP's per-bucket and per-step
    bookkeeping dominate), 6x the steps for the small one."""
    def make_model():
        return deep_mlp(width, depth)

    memory = {str(views): gradient_bytes(make_model(), views, steps=3, batch=_batch) for views in (False, True)}
    hooks = hook_bytes_and_deviation(make_model)
    models = {"mlp": (make_model, steps), "cnn": (small_cnn, 6 * steps)}
    times = {model: {name: [] for name in STEP_CONFIGS} for model in models}
    for _ in range(repeats):  # interleaved: every config once per round
        for model, (make, n) in models.items():
            for name, kwargs in STEP_CONFIGS.items():
                times[model][name].append(step_seconds(make, kwargs, n))
    return {"memory": memory, "hooks": hooks, "step_s": times}


def _measure_main(rank: int, world_size: int, port: int, out_dir: str, width: int, depth: int, steps: int,
                  repeats: int) -> None:
    from manual_train.distributed import read_env, setup, teardown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for several ranks on one node
    setup(read_env(), torch.device("cpu"), "gloo", 600)
    try:
        result = measure_rank(width, depth, steps, repeats)
    finally:
        teardown()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def measure(world_size: int = 2, width: int = 1024, depth: int = 16, steps: int = 5, repeats: int = 3,
            start_method: str = "spawn") -> dict:
    """N gloo processes run measure_rank; returns {"world_size", "params", "ranks": [each rank's measure_rank]}."""
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # as torchrun's agent hosts it
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_measure_main, args=(world_size, store.port, out_dir, width, depth, steps, repeats),
                           nprocs=world_size, join=True, start_method=start_method)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    del store
    params = sum(p.numel() for p in deep_mlp(width, depth).parameters())
    return {"world_size": world_size, "width": width, "depth": depth, "params": params, "ranks": ranks}


# ---------------------------------------------------------------------- the CPU suite's entry
def _ddp_knobs_child(width: int, depth: int, steps: int, repeats: int) -> dict:
    # fork: the ranks start from this fresh process (torch already imported) instead of new pythons
    return measure(2, width, depth, steps, repeats, start_method="fork")


def ddp_knobs(bench):
    """Rows: gradient bytes held with and without bucket views; bytes sent per step by each --comm-hook and its
    deviation from exact DDP; step time against the bucket cap and the other knobs (reported only)."""
    from manual_train.bench.harness import Outcome, ratio_row, value_row

    width = bench.pick(512, 1024)
    raw = bench.child(_ddp_knobs_child, width=width, depth=16, steps=bench.pick(3, 5),
                      repeats=bench.repeats(2, 3))
    ranks, entry, rows, notes = raw["ranks"], bench.entry, [], []
    model = f"MLP {width} x 16, {raw['params'] / 1e6:.1f} M params, 2 ranks"
    for point in ("after_backward", "after_step", "after_zero_grad"):
        plain = [r["memory"]["False"][point] for r in ranks]
        views = [r["memory"]["True"][point] for r in ranks]
        rows.append(ratio_row(entry, "plain DDP", "gradient_as_bucket_view", f"gradient bytes held {point} "
                              f"(.grad + buckets, tensor bytes; {model})", plain, views,
                              claim="one gradient copy less: 0.5 after backward and step"))
    grad_mib = ranks[0]["memory"]["False"]["param_bytes"] / MIB
    notes.append(f"gradients {grad_mib:.1f} MiB per rank; held after backward: plain "
                 f"{ranks[0]['memory']['False']['after_backward'] / MIB:.1f} MiB, with bucket views "
                 f"{ranks[0]['memory']['True']['after_backward'] / MIB:.1f} MiB; after zero_grad(set_to_none=True) "
                 f"both keep the buckets ({ranks[0]['memory']['True']['after_zero_grad'] / MIB:.1f} MiB)")
    hooks = ranks[0]["hooks"]
    for kind in ("fp16", "bf16", "powersgd"):
        rows.append(ratio_row(entry, "--comm-hook none", f"--comm-hook {kind}",
                              f"bytes all-reduced per step per rank (counting_hook; one bucket; {model})",
                              [hooks["none"]["bytes_per_step"]], [hooks[kind]["bytes_per_step"]],
                              claim="fp16/bf16 0.5; PowerSGD rank 1 far less (lossy)"))
        rows.append(value_row(entry, "--comm-hook none", f"--comm-hook {kind}",
                              "max abs weight deviation from exact DDP after 30 SGD steps (fp32)",
                              [hooks[kind]["deviation"]], unit="abs"))
    notes.append(f"bytes per step per rank: none {hooks['none']['bytes_per_step']:,}, fp16 "
                 f"{hooks['fp16']['bytes_per_step']:,}, bf16 {hooks['bf16']['bytes_per_step']:,}, powersgd "
                 f"{hooks['powersgd']['bytes_per_step']:,} (its first 10: {hooks['powersgd']['bytes_first_step']:,})")
    for net, what in (("mlp", model), ("cnn", "the digits CNN, 0.34 MiB in 10 tensors, 2 ranks")):
        rounds = range(len(ranks[0]["step_s"][net]["default"]))  # each round: the slowest rank's step (the group's)
        times = {name: [max(r["step_s"][net][name][i] for r in ranks) for i in rounds] for name in STEP_CONFIGS}
        for name in STEP_CONFIGS:
            if name != "default":
                rows.append(ratio_row(entry, "DDP defaults", name, f"seconds per step ({what}; reported only)",
                                      times["default"], times[name]))
        notes.append(f"{what}: {statistics.median(times['default']) * 1e3:.1f} ms per step with DDP's defaults")
    notes.append("Step times on 2 shared cores: the all-reduce is a copy between processes on the same cores, so "
                 "these show DDP's bookkeeping per bucket and per graph walk, not communication overlap.")
    return Outcome(rows, raw, notes)
