"""GPU entries (`python -m manual_train.bench --suite gpu`): precision, copies, host syncs, compile, cuDNN, MFU,
TF32, CUDA graphs.

Written to be run on a CUDA machine by scripts/gpu_check.sh. Every `_..._child` function runs in
a fresh process and takes a `device` argument, so tests/test_bench.py can walk its code on the CPU
with tiny sizes; CUDA-only readings (events, allocator peaks, the sync debug mode) are None there.

How it measures on CUDA:
  time    CUDA events around a block of steps (the host only queues kernels, so a host clock would
          time the queueing); blocks of each variant interleaved A B A B, medians over blocks.
  memory  torch.cuda.max_memory_allocated over one step after reset_peak_memory_stats, minus what
          was allocated before the variant was built: that variant's weights, gradients, optimizer
          state, batch and activations at their peak, even with other variants alive in the process.
  syncs   torch.cuda.set_sync_debug_mode("warn") makes each synchronising call (.item(), .cpu(),
          nonzero, ...) emit a warning; the warnings are counted per step.
  FLOPs   torch.utils.flop_counter.FlopCounterMode over one training step with SDPA forced to its math
          path, so attention counts as the matmuls it is (model FLOPs, without flash-attention's
          recomputation); checked against the PaLM formula 6*N*tokens + 12*L*d*T*tokens.
  MFU     those FLOPs over the step time, against the datasheet's dense bf16 peak (DATASHEET_BF16_DENSE) and
          against a measured one: 8192^3 bf16 matmuls after ~1 s of warm-up (an idle GPU's clock is low), best
          of several blocks of back-to-back products timed by one event pair each (matmul_peak_flops).
"""
from __future__ import annotations

import functools
import statistics
import time
import warnings
from contextlib import nullcontext

from manual_train.bench.harness import Bench, Goal, Outcome, ratio_row, seconds_per_step, value_row

CLAIM_AMP = "mixed precision 1.5-2x faster (art. 2); 16-bit halves memory (art. 1)"
CLAIM_PIN = "pin_memory=True speeds up transfers to the GPU (art. 2)"
CLAIM_SYNC = "avoid forced GPU syncs; Lightning takes care of them (art. 1)"
PRECISIONS = ("32-true", "tf32", "bf16-mixed", "16-mixed", "16-o2")
# nanoGPT-style sizes for the GPT of manual_train/models.py: quick fits a minute of the GPU suite,
# full is GPT-2 small (124M parameters).
GPT_SIZES = {"quick": dict(vocab=8192, block_size=512, n_layer=6, n_head=8, n_embd=512),
             "full": dict(vocab=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)}


# ---------------------------------------------------------------------- device facts and switches
def cuda_info() -> dict:
    """What torch sees of CUDA (runs in a child; the orchestrator never imports torch)."""
    import torch

    info = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if info["available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count(),
                    total_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                    bf16_supported=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
    return info


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matmuls and convolutions, or true IEEE float32 for both.

    torch's defaults differ per library (cuBLAS matmuls: IEEE; cuDNN convolutions: TF32), so a
    "32-true" measurement has to switch cuDNN's off explicitly. The allow_tf32 flags are used, not
    torch >= 2.9's fp32_precision settings: setting those leaves the allow_tf32 getters (which other
    code, e.g. compilers, still read) raising "mix of the legacy and new APIs"; setting allow_tf32
    updates both (checked on torch 2.14).
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 announces that allow_tf32 will be deprecated
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


# ---------------------------------------------------------------------- models, batches, the step
def build_bench_model(name: str, size: str = "quick", image_side: int = 224):
    """(model, make_batch(batch_size, device)) for resnet18/resnet50 (torchvision, ImageNet shapes) or gpt."""
    import torch

    if name == "gpt":
        from manual_train.models import GPT

        sizes = GPT_SIZES[size] if isinstance(size, str) else size
        model = GPT(**sizes)

        def make_batch(batch_size, device):
            tokens = torch.randint(sizes["vocab"], (batch_size, sizes["block_size"] + 1), device=device)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # next-token targets
        return model, make_batch

    import torchvision

    model = getattr(torchvision.models, name)(num_classes=1000)

    def make_batch(batch_size, device):
        return (torch.randn(batch_size, 3, image_side, image_side, device=device),
                torch.randint(1000, (batch_size,), device=device))
    return model, make_batch


def seeded_bench_model(name: str, batch_size: int, device, size="quick", image_side: int = 224):
    """build_bench_model after torch.manual_seed(0), so every variant of an entry starts from the same weights and
    batch: (the model on `device`, x, y)."""
    import torch

    torch.manual_seed(0)
    model, make_batch = build_bench_model(name, size, image_side)
    x, y = make_batch(batch_size, device)
    return model.to(device), x, y


def timed_warmup(step, warmup: int, device) -> float:
    """Seconds that `warmup` calls of step() take until the device has run them: where torch.compile traces and
    compiles, reduce-overhead records its CUDA graphs and cudnn.benchmark tries every algorithm."""
    import torch

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def make_step(model, precision: str, device, x, y, lr: float = 0.01):
    """One training step as the loops take it: torch.amp inline (loops/single.py), or apex's O2 written out
    (loops/apex_o2.py) for 16-o2.

    tf32 is 32-true with TF32 switched on (set_tf32, by the caller, before each block). Returns
    (step, the optimizer's parameters); step() queues the work and returns without a host sync,
    except where the precision itself syncs (16-mixed: GradScaler.step; 16-o2: the overflow check).
    """
    import torch

    from manual_train.models import loss_fn
    from manual_train.precision import autocast_for

    if precision == "16-o2":
        return _o2_step(model, x, y, lr)
    autocast = autocast_for("32-true" if precision == "tf32" else precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    return step, params


def _o2_step(model, x, y, lr: float):
    """make_step for 16-o2: loops/apex_o2.py's step (fp16 model, fp32 masters, apex's dynamic loss scale)."""
    import torch

    from manual_train.models import loss_fn
    from manual_train.apex_o2 import DynamicLossScaler, O2Forward, cast_o2

    model_params = [p for p in model.parameters() if p.requires_grad]
    master_params = [torch.nn.Parameter(p.detach().clone()) for p in model_params]
    model = O2Forward(cast_o2(model))
    optimizer = torch.optim.SGD(master_params, lr=lr, momentum=0.9)
    scaler = DynamicLossScaler()

    def step():
        optimizer.zero_grad()
        (loss_fn(model(x), y) * scaler.scale).backward()
        for p, master in zip(model_params, master_params):
            master.grad = None if p.grad is None else p.grad.float().mul_(1.0 / scaler.scale)
            p.grad = None
        grads = [m.grad for m in master_params if m.grad is not None]
        found_inf = bool(grads) and not torch.stack([g.isfinite().all() for g in grads]).all().item()  # the sync
        if not found_inf:
            optimizer.step()
            with torch.no_grad():
                for p, master in zip(model_params, master_params):
                    p.copy_(master)
        scaler.update(found_inf)
    return step, master_params


# ---------------------------------------------------------------------- precision x layout x model
def _precision_child(model_name: str, layouts: tuple, precisions: tuple, batch_size: int, size: str,
                     image_side: int, warmup: int, steps: int, rounds: int, device: str = "cuda") -> dict:
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    variants, peak_bytes = {}, {}
    for layout in layouts:
        for precision in precisions:
            name = f"{precision}/{layout}"
            set_tf32(precision == "tf32")
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(device)
            model, x, y = seeded_bench_model(model_name, batch_size, device, size, image_side)
            if layout == "channels_last":
                # NHWC: cuDNN's tensor-core convolutions read this layout without transposing it first
                model.to(memory_format=torch.channels_last)
                x = x.contiguous(memory_format=torch.channels_last)
            step, _ = make_step(model, precision, device, x, y)
            for _ in range(warmup):
                step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                step()
                torch.cuda.synchronize()
                peak_bytes[name] = torch.cuda.max_memory_allocated(device) - before
            variants[name] = step

    def block(name):
        set_tf32(name.startswith("tf32/"))
        return seconds_per_step(variants[name], steps, device)

    times = interleave_blocks({n: functools.partial(block, n) for n in variants}, rounds)
    return {"step_s": times, "peak_bytes": peak_bytes}


def interleave_blocks(blocks: dict, rounds: int) -> dict:
    from manual_train.bench.harness import interleave

    return interleave(blocks, rounds, warmup=0)  # each variant was warmed up when it was built


def _precision_rows(entry: str, model_name: str, raw: dict, layouts: tuple, hopper: bool, what: str) -> list:
    rows = []
    times, peaks = raw["step_s"], raw["peak_bytes"]
    for layout in layouts:
        base = f"32-true/{layout}"
        for precision in PRECISIONS[1:]:
            goal = Goal("<=", 0.5) if precision == "bf16-mixed" and hopper else None
            rows.append(ratio_row(entry, base, f"{precision}/{layout}", f"step time, {what}", times[base],
                                  times[f"{precision}/{layout}"], claim=CLAIM_AMP, goal=goal))
        for precision in ("bf16-mixed", "16-o2"):
            if base in peaks:
                rows.append(ratio_row(entry, base, f"{precision}/{layout}", f"peak memory of a step, {what}",
                                      [peaks[base]], [peaks[f"{precision}/{layout}"]], claim=CLAIM_AMP))
    if len(layouts) == 2:
        for precision in ("32-true", "bf16-mixed"):
            rows.append(ratio_row(entry, f"{precision}/contiguous", f"{precision}/channels_last",
                                  f"step time, {what}", times[f"{precision}/contiguous"],
                                  times[f"{precision}/channels_last"]))
    return rows


def precision(bench: Bench) -> Outcome:
    hopper = str(bench.device_info.get("capability", "")).startswith("9.")
    rounds, steps = bench.repeats(3, 7), bench.pick(5, 10)
    size = "quick" if bench.quick else "full"
    image_models = {"resnet18": 256, "resnet50": 128}  # batch sizes
    raw, rows = {}, []
    for model_name, batch_size in image_models.items():
        layouts = ("contiguous", "channels_last")
        raw[model_name] = bench.child(_precision_child, model_name=model_name, layouts=layouts, precisions=PRECISIONS,
                                      batch_size=batch_size, size=size, image_side=224, warmup=3, steps=steps,
                                      rounds=rounds)
        rows += _precision_rows(bench.entry, model_name, raw[model_name], layouts, hopper,
                                f"{model_name}, 224x224, batch {batch_size}")
    gpt_batch = bench.pick(32, 16)
    raw["gpt"] = bench.child(_precision_child, model_name="gpt", layouts=("contiguous",), precisions=PRECISIONS,
                             batch_size=gpt_batch, size=size, image_side=0, warmup=3, steps=steps, rounds=rounds)
    sizes = GPT_SIZES[size]
    rows += _precision_rows(bench.entry, "gpt", raw["gpt"], ("contiguous",), hopper,
                            f"gpt {sizes['n_layer']}x{sizes['n_embd']}, {gpt_batch}x{sizes['block_size']} tokens")
    notes = ["32-true is IEEE float32 throughout (cuDNN's default TF32 switched off); tf32 switches TF32 on for "
             "matmuls and convolutions; 16-o2 is manual_train's written-out apex O2. cudnn.benchmark is off "
             "(torch's default; the cudnn_benchmark entry measures it)."]
    if not hopper:
        notes.append("The bf16-mixed <= 0.5 goal is for Hopper GPUs; this device is not one, so it is not applied.")
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- pinned vs pageable copies
def _copies_child(batch_shape: tuple, batches: int, rounds: int, device: str = "cuda") -> dict:
    """Host-to-device copies of uint8 image batches: pageable + blocking vs pinned + non_blocking.

    Two readings per variant: the wall time until every copy has landed, and the host time spent
    inside .to() (what the Python loop waits before it can prepare the next batch or queue compute).
    """
    import torch

    device = torch.device(device)
    pageable = [torch.randint(0, 256, batch_shape, dtype=torch.uint8) for _ in range(batches)]
    pinned = [t.pin_memory() for t in pageable]  # page-locked: the GPU's DMA engine reads it directly
    nbytes = sum(t.numel() for t in pageable)

    def copy_all(host, non_blocking: bool) -> tuple:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        on_device = [t.to(device, non_blocking=non_blocking) for t in host]
        t_host = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        del on_device
        return time.perf_counter() - t0, t_host

    variants = {"pageable": functools.partial(copy_all, pageable, False),
                "pinned_non_blocking": functools.partial(copy_all, pinned, True),
                "pageable_non_blocking": functools.partial(copy_all, pageable, True)}
    from manual_train.bench.harness import interleave

    result = interleave(variants, rounds, warmup=1)
    return {"bytes": nbytes, **{k: {"total_s": [a for a, _ in v], "host_s": [b for _, b in v]}
                                for k, v in result.items()}}


def copies(bench: Bench) -> Outcome:
    shape, n = (256, 3, 224, 224), bench.pick(8, 16)
    raw = bench.child(_copies_child, batch_shape=shape, batches=n, rounds=bench.repeats(5, 10))
    gb = raw["bytes"] / 1e9
    what = f"{n} uint8 batches of {'x'.join(map(str, shape))} ({gb:.2f} GB)"
    rows = []
    labels = {"pinned_non_blocking": "pinned, .to(device, non_blocking=True)",
              "pageable_non_blocking": "pageable, .to(device, non_blocking=True)"}
    for variant, label in labels.items():
        rows.append(ratio_row(bench.entry, "pageable, .to(device)", label, f"time until all copies landed, {what}",
                              raw["pageable"]["total_s"], raw[variant]["total_s"], claim=CLAIM_PIN))
        rows.append(ratio_row(bench.entry, "pageable, .to(device)", label, "host time inside .to()",
                              raw["pageable"]["host_s"], raw[variant]["host_s"], claim=CLAIM_PIN))
    notes = [f"copy bandwidth (best round): pinned {gb / min(raw['pinned_non_blocking']['total_s']):.1f} GB/s, "
             f"pageable {gb / min(raw['pageable']['total_s']):.1f} GB/s. From pageable memory the driver stages "
             "the copy through a pinned buffer, so non_blocking=True is expected to save little there."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- host syncs per step
def count_syncs(fn) -> int:
    """How many synchronising CUDA calls fn() makes (torch.cuda.set_sync_debug_mode('warn'))."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per call site
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


SYNC_VARIANTS = {
    "item": "losses.append(loss.item()) every step",
    "append": "losses.append(loss) every step",
    "ours": "ours: device sums of loss.detach(), .item() every log step",
}


def _syncs_per_step_child(steps: int, log_every: int, precision: str = "32-true", device: str = "cuda") -> dict:
    """Per-step sync counts of the logging idioms, with the step of loops.single around them."""
    import torch

    from manual_train.models import MLP, correct_count, loss_fn
    from manual_train.precision import autocast_for

    device = torch.device(device)
    cuda = device.type == "cuda"
    x = torch.randn(256, 1, 8, 8, device=device)
    y = torch.randint(10, (256,), device=device)
    result = {}
    for variant in SYNC_VARIANTS:
        torch.manual_seed(0)
        model = MLP((1, 8, 8), 10).to(device)
        autocast = autocast_for(precision, device)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        losses = []
        loss_sum = torch.zeros((), device=device)
        correct_sum = torch.zeros((), device=device)

        def step(i):
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                logits = model(x)
                loss = loss_fn(logits, y)
            scaler.scale(loss).backward()
            if variant == "item":
                losses.append(loss.item())
            elif variant == "append":
                losses.append(loss)
            else:
                loss_sum.add_(loss.detach())
                correct_sum.add_(correct_count(logits.detach(), y))
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            if variant == "ours" and (i + 1) % log_every == 0:
                losses.append((loss_sum / log_every).item())  # the log step's host sync
                loss_sum.zero_(), correct_sum.zero_()

        for i in range(3):
            step(i)
        counts = [count_syncs(functools.partial(step, i)) if cuda else None for i in range(steps)]
        result[variant] = {"syncs": counts, "log_steps": [i for i in range(steps) if (i + 1) % log_every == 0]}
    return result


def _loop_syncs_child(short_steps: int, long_steps: int, precision: str, device: str = "cuda") -> dict:
    """Syncs of the real loop's train (loops.single; loops.apex_o2 for 16-o2) in two runs that differ only in their
    number of non-log steps.

    Both runs log once (their last step), evaluate once and checkpoint once, so the difference in syncs,
    divided by the difference in steps, is what one non-log step of the real loop costs.
    """
    import tempfile
    from pathlib import Path

    import torch

    from manual_train.config import O2_PRECISIONS, Config, parse_config
    from manual_train.loops import apex_o2, single
    from manual_train.apex_o2 import ApexO2Config

    o2 = precision in O2_PRECISIONS
    train = apex_o2.train if o2 else single.train

    def config(*argv):
        return parse_config(ApexO2Config if o2 else Config, list(argv))

    counts = {}
    args = ("--dataset", "synthetic", "--synthetic-size", "4096", "--synthetic-shape", "3,32,32", "--model", "cnn",
            "--batch-size", "64", "--log-every", "100000", "--early-stop-patience", "0", "--precision", precision,
            "--device", device, "--no-progress")
    with tempfile.TemporaryDirectory() as tmp:
        train(config(*args, "--max-steps", "2", "--out-dir", str(Path(tmp) / "warmup")))
        for steps in (short_steps, long_steps):
            cfg = config(*args, "--max-steps", str(steps), "--out-dir", str(Path(tmp) / f"run{steps}"))
            counts[steps] = count_syncs(functools.partial(train, cfg)) if torch.device(device).type == "cuda" \
                else None
    return {"short_steps": short_steps, "long_steps": long_steps, "syncs": counts}


def syncs(bench: Bench) -> Outcome:
    steps, log_every = 20, 10
    raw = {"idioms": bench.child(_syncs_per_step_child, steps=steps, log_every=log_every)}
    rows = []
    for variant, label in SYNC_VARIANTS.items():
        r = raw["idioms"][variant]
        non_log = [c for i, c in enumerate(r["syncs"]) if i not in r["log_steps"]]
        rows.append(value_row(bench.entry, "-", label, "host syncs per non-log step (mlp, 32-true)", non_log,
                              unit="syncs", claim=CLAIM_SYNC, goal=Goal("<=", 0) if variant == "ours" else None))
    for precision in ("32-true", "16-mixed", "16-o2"):
        r = bench.child(_loop_syncs_child, short_steps=10, long_steps=40, precision=precision)
        raw[f"loop {precision}"] = r
        per_step = (r["syncs"][40] - r["syncs"][10]) / 30
        loop = "apex_o2" if precision == "16-o2" else "single"
        rows.append(value_row(bench.entry, "-", f"loops.{loop}.train, {precision}",
                              "host syncs per non-log step (40- vs 10-step run)", [per_step], unit="syncs",
                              claim=CLAIM_SYNC, goal=Goal("<=", 0) if precision == "32-true" else None))
    notes = ["Mixed precision syncs by design: 16-mixed twice per step (GradScaler.step reads found_inf on the "
             "host to decide whether to skip the step, and Run.stepped reads get_scale() to learn "
             "what it decided), 16-o2 once (its overflow check). Counted with torch.cuda.set_sync_debug_mode, "
             "which sees .item()/.cpu()/nonzero-style syncs but not torch.cuda.synchronize or collectives."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- cudnn.benchmark
def _cudnn_child(benchmark: bool, model_name: str, batch_size: int, precision: str, warmup: int, steps: int,
                 rounds: int, image_side: int = 224, device: str = "cuda") -> dict:
    """One setting per process: cuDNN's algorithm cache is shared by both settings, so a process that
    has run with one would answer the other from its cache."""
    import torch

    device = torch.device(device)
    torch.backends.cudnn.benchmark = benchmark
    set_tf32(False)
    model, x, y = seeded_bench_model(model_name, batch_size, device, image_side=image_side)
    model.to(memory_format=torch.channels_last)
    step, _ = make_step(model, precision, device, x.contiguous(memory_format=torch.channels_last), y)
    warmup_s = timed_warmup(step, warmup, device)  # benchmark=True: a new shape's first step tries every algorithm
    return {"step_s": [seconds_per_step(step, steps, device) for _ in range(rounds)], "warmup_s": warmup_s}


def cudnn_benchmark(bench: Bench) -> Outcome:
    model_name, batch_size = "resnet50", 128
    raw = {"off": [], "on": []}
    for _ in range(bench.repeats(2, 4)):  # one process per reading, interleaved
        for key, flag in (("off", False), ("on", True)):
            raw[key].append(bench.child(_cudnn_child, benchmark=flag, model_name=model_name, batch_size=batch_size,
                                        precision="bf16-mixed", warmup=3, steps=bench.pick(10, 20), rounds=3))
    off = [statistics.median(r["step_s"]) for r in raw["off"]]
    on = [statistics.median(r["step_s"]) for r in raw["on"]]
    what = f"{model_name} bf16-mixed channels_last, batch {batch_size}"
    rows = [ratio_row(bench.entry, "cudnn.benchmark=False", "cudnn.benchmark=True", f"step time, {what}", off, on),
            ratio_row(bench.entry, "cudnn.benchmark=False", "cudnn.benchmark=True", "time of the 3 warm-up steps",
                      [r["warmup_s"] for r in raw["off"]], [r["warmup_s"] for r in raw["on"]])]
    return Outcome(rows, raw, [])


# ---------------------------------------------------------------------- FLOPs, MFU, torch.compile
def gpt_flops_per_step(model, batch_size: int, seq_len: int) -> int:
    """Model FLOPs of one GPT training step (forward + backward), as PaLM's appendix B counts them:
    6 per parameter per token for the matmul weights, plus 12*L*d*T per token for attention scores
    and their use (causal masking not discounted, flash attention's recomputation not counted)."""
    import torch.nn as nn

    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tokens = batch_size * seq_len
    n_layer, d = len(model.blocks), model.tok.embedding_dim
    return 6 * matmul_params * tokens + 12 * n_layer * d * seq_len * tokens


def count_step_flops(model, x, y, autocast=nullcontext) -> int:
    """FLOPs of one forward + backward, counted op by op by torch's FlopCounterMode.

    SDPA runs its math path here so attention is counted as the matmuls it is; the gradients the
    count leaves behind are dropped.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from manual_train.models import loss_fn

    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        with autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def mfu(flops_per_step: float, step_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the fraction of the peak rate the step's model FLOPs achieve."""
    return flops_per_step / step_s / peak_flops_per_s


# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's datasheets, which print the 2:4-sparsity figure: dense is
# half of it. Matched against torch.cuda.get_device_name() in this order, the first substring that occurs wins.
DATASHEET_BF16_DENSE = (
    ("H200 NVL", 835e12, "NVIDIA H200 NVL datasheet: 1,671 TFLOPS bf16 with sparsity, halved"),
    ("H200", 989e12, "NVIDIA H200 (SXM) datasheet: 1,979 TFLOPS bf16 with sparsity, halved"),
    ("H100 PCIe", 756e12, "NVIDIA H100 PCIe datasheet: 1,513 TFLOPS bf16 with sparsity, halved"),
    ("H100", 989e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, halved"),
    ("A100", 312e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
)


def datasheet_bf16_peak(device_name: str):
    """(dense bf16 FLOP/s, where the number comes from) for a GPU named like torch reports it, or None."""
    for key, flops, source in DATASHEET_BF16_DENSE:
        if key in device_name:
            return flops, source
    return None


def matmul_peak_flops(device, n: int = 8192, dtype_name: str = "bfloat16", warmup_s: float = 1.0,
                      matmuls_per_block: int = 20, blocks: int = 5) -> dict:
    """FLOP/s of n x n x n matmuls on random data, after about `warmup_s` of them.

    An idle GPU runs at a low clock (an H200 read 345 MHz idle, 1980 MHz under load) and takes longer
    than a few products to raise it: a peak timed after ~5 ms of warm-up is a slow GPU's, which inflates every
    MFU computed against it. So: products for about a second first, then `blocks` blocks of `matmuls_per_block`
    back-to-back products, one pair of CUDA events per block. Timing products one by one would wait on the host
    after each (the end event's synchronize) and start the next from an idle GPU; a block keeps it busy, as a
    training step does. The peak is the best block, the least flattering reference for MFU; the median comes
    along.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t0, warmup_matmuls = time.perf_counter(), 0
    while warmup_matmuls == 0 or time.perf_counter() - t0 < warmup_s:
        for _ in range(8):
            torch.matmul(a, b, out=out)
        warmup_matmuls += 8
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the host clock must see the GPU's time, not the queueing
    warmup_s = time.perf_counter() - t0
    block_s = [seconds_per_step(lambda: torch.matmul(a, b, out=out), matmuls_per_block, device)
               for _ in range(blocks)]
    rates = [2 * n ** 3 / t for t in block_s]
    return {"flops_per_s": max(rates), "median_flops_per_s": statistics.median(rates), "n": n,
            "warmup_s": warmup_s, "warmup_matmuls": warmup_matmuls,
            "matmuls_per_block": matmuls_per_block, "block_s": block_s}


def _gpt_child(size, batch_size: int, warmup: int, steps: int, rounds: int, compile_model: bool,
               device: str = "cuda", peak_n: int = 8192, peak_warmup_s: float = 1.0) -> dict:
    """bf16-mixed GPT steps, eager and (optionally) torch.compile'd, with FLOPs counted and the peak measured."""
    import torch

    device = torch.device(device)
    set_tf32(False)
    peak = matmul_peak_flops(device, n=peak_n, warmup_s=peak_warmup_s)
    variants, result = {}, {"peak_flops_per_s": peak["flops_per_s"], "peak": peak, "compile_s": None}
    for name in ("eager", "compiled") if compile_model else ("eager",):
        model, x, y = seeded_bench_model("gpt", batch_size, device, size)
        if name == "eager":
            amp_autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
            result["flops_counted"] = count_step_flops(model, x, y, amp_autocast)
            result["flops_formula"] = gpt_flops_per_step(model, batch_size, x.shape[1])
        else:
            model = torch.compile(model)
        step, _ = make_step(model, "bf16-mixed", device, x, y)
        warmup_s = timed_warmup(step, warmup, device)  # compiled: the first call traces and compiles fwd and bwd
        if name == "compiled":
            result["compile_s"] = warmup_s
        variants[name] = functools.partial(seconds_per_step, step, steps, device)
    result["step_s"] = interleave_blocks(variants, rounds)
    return result


def gpt_compile_mfu(bench: Bench) -> Outcome:
    size = "quick" if bench.quick else "full"
    batch_size = bench.pick(32, 16)
    raw = bench.child(_gpt_child, size=size, batch_size=batch_size, warmup=3, steps=bench.pick(10, 20),
                      rounds=bench.repeats(3, 5), compile_model=True, timeout_s=900)
    sizes = GPT_SIZES[size]
    what = f"gpt {sizes['n_layer']}x{sizes['n_embd']}, {batch_size}x{sizes['block_size']} tokens, bf16-mixed"
    times = raw["step_s"]
    rows = [ratio_row(bench.entry, "eager", "torch.compile", f"step time, {what}", times["eager"], times["compiled"]),
            value_row(bench.entry, "-", "torch.compile", "time of the first 3 steps (compilation)", [raw["compile_s"]],
                      unit="s")]
    peak = raw["peak_flops_per_s"]
    datasheet = datasheet_bf16_peak(bench.device_info.get("name", ""))
    for name in ("eager", "compiled"):
        # MFU against the datasheet's dense peak is the usual definition (PaLM, appendix B: the hardware's
        # theoretical peak); against the measured matmul peak it says how close the step gets to what this GPU
        # actually sustains on the best case for its tensor cores
        if datasheet:
            rows.append(value_row(bench.entry, f"datasheet bf16 dense peak ({datasheet[0] / 1e12:.0f} TFLOP/s)",
                                  f"gpt step, {name}", f"MFU, {what}",
                                  [100 * mfu(raw["flops_counted"], t, datasheet[0]) for t in times[name]], unit="%",
                                  goal=Goal(">=", 40)))
        rows.append(value_row(bench.entry, "bf16 matmul peak (measured)", f"gpt step, {name}",
                              f"MFU against the measured peak, {what}",
                              [100 * mfu(raw["flops_counted"], t, peak) for t in times[name]], unit="%",
                              goal=None if datasheet else Goal(">=", 40)))
    details = raw["peak"]
    n = details["n"]
    rows.append(value_row(bench.entry, "-", f"{n}^3 bf16 matmul", "measured peak (best block)", [peak / 1e12],
                          unit="TFLOP/s"))
    notes = [f"FLOPs per step: {raw['flops_counted'] / 1e12:.3f} T counted by FlopCounterMode, "
             f"{raw['flops_formula'] / 1e12:.3f} T by the PaLM formula."]
    measured = (f"Measured peak: the best of {len(details['block_s'])} blocks of {details['matmuls_per_block']} "
                f"back-to-back {n}^3 bf16 matmuls (one CUDA event pair per block) after {details['warmup_s']:.1f} s "
                f"of warm-up matmuls: {peak / 1e12:.0f} TFLOP/s (median block "
                f"{details['median_flops_per_s'] / 1e12:.0f})")
    if datasheet:
        notes.append(f"{measured}, {100 * peak / datasheet[0]:.0f}% of the datasheet's {datasheet[0] / 1e12:.0f}. "
                     f"Datasheet peak: {datasheet[1]}. The goal applies to MFU against the datasheet.")
    else:
        notes.append(f"{measured}. No datasheet peak is known here for {bench.device_info.get('name', 'this GPU')}, "
                     "so the goal applies to MFU against the measured peak (which flatters it).")
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- CUDA graphs, TF32 (docs/levers.md)
# A GPT small enough that a step is bound by kernel launches on an H200 (~60 kernels a block, each microseconds of
# work): where replaying a CUDA graph, one launch instead of hundreds, can show.
LAUNCH_BOUND_GPT = dict(vocab=4096, block_size=128, n_layer=4, n_head=4, n_embd=256)
COMPILE_MODES = ("eager", "default", "reduce-overhead")


def _cuda_graphs_child(size, batch_size: int, warmup: int, steps: int, rounds: int, device: str = "cuda") -> dict:
    """bf16-mixed GPT step times: eager, torch.compile (Inductor's kernels, each launched by the host) and
    torch.compile(mode="reduce-overhead") (the same kernels recorded into CUDA graphs and replayed: one launch per
    graph). Each compiled step starts with cudagraph_mark_step_begin(): the previous step's graph outputs may be
    overwritten. On a CPU only eager runs (CUDA graphs need CUDA; compiling there takes a minute)."""
    import torch

    device = torch.device(device)
    variants, warmup_s = {}, {}
    for mode in COMPILE_MODES if device.type == "cuda" else COMPILE_MODES[:1]:
        model, x, y = seeded_bench_model("gpt", batch_size, device, size)
        if mode != "eager":
            model = torch.compile(model, mode=None if mode == "default" else mode)
        step, _ = make_step(model, "bf16-mixed", device, x, y)
        if mode == "reduce-overhead":
            step = functools.partial(_step_marked, step)
        warmup_s[mode] = timed_warmup(step, warmup, device)  # compiles; reduce-overhead also records its graphs
        variants[mode] = functools.partial(seconds_per_step, step, steps, device)
    return {"step_s": interleave_blocks(variants, rounds), "warmup_s": warmup_s}


def _step_marked(step) -> None:
    import torch

    torch.compiler.cudagraph_mark_step_begin()
    step()


def cuda_graphs(bench: Bench) -> Outcome:
    size, batch_size = LAUNCH_BOUND_GPT, bench.pick(8, 16)
    raw = bench.child(_cuda_graphs_child, size=size, batch_size=batch_size, warmup=bench.pick(5, 10),
                      steps=bench.pick(20, 50), rounds=bench.repeats(3, 5), timeout_s=900)
    what = f"gpt {size['n_layer']}x{size['n_embd']}, {batch_size}x{size['block_size']} tokens, bf16-mixed"
    times = raw["step_s"]
    rows = [value_row(bench.entry, "-", "eager", f"seconds per step, {what}", times["eager"], unit="s")]
    if "default" in times:
        rows += [ratio_row(bench.entry, "eager", "torch.compile", f"step time, {what}", times["eager"],
                           times["default"]),
                 ratio_row(bench.entry, "eager", "compile reduce-overhead", f"step time, {what}", times["eager"],
                           times["reduce-overhead"]),
                 ratio_row(bench.entry, "torch.compile", "compile reduce-overhead", f"step time, {what} (CUDA "
                           "graphs' own share)", times["default"], times["reduce-overhead"])]
        rows += [value_row(bench.entry, "-", f"compile {mode}", f"time of the first {bench.pick(5, 10)} steps "
                           "(compile, record)", [raw["warmup_s"][mode]], unit="s") for mode in COMPILE_MODES[1:]]
    return Outcome(rows, raw, ["Reported, no goal (none is set): CUDA graphs save the host's kernel launches, "
                               "which matter most on a launch-bound step like this small GPT's."])


def _tf32_child(size, batch_size: int, steps: int, rounds: int, device: str = "cuda") -> dict:
    """A float32 GPT step with TF32 matmuls off (IEEE float32) and on (torch.backends.cuda.matmul.allow_tf32, what
    torch.set_float32_matmul_precision("high") sets): step times, and how far TF32 moves the numbers from the
    same start: the logits of one forward, the weights after `steps` steps. On a CPU the flag changes nothing
    (the deviations are 0): the code is walked there."""
    import torch

    device = torch.device(device)
    model, x, y = seeded_bench_model("gpt", batch_size, device, size)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    logits, weights, variants = {}, {}, {}
    try:
        for name, tf32 in (("ieee", False), ("tf32", True)):
            set_tf32(tf32)
            model.load_state_dict(start)
            with torch.no_grad():
                logits[name] = model(x).float()
            step, params = make_step(model, "tf32" if tf32 else "32-true", device, x, y)
            for _ in range(steps):
                step()
            weights[name] = [p.detach().clone() for p in params]
            variants[name] = functools.partial(_tf32_timed, tf32, step, steps, device)
        times = interleave_blocks(variants, rounds)
    finally:
        set_tf32(False)
    return {"step_s": times, "logit_max_abs": logits["ieee"].abs().max().item(),
            "logit_deviation": (logits["tf32"] - logits["ieee"]).abs().max().item(),
            "weight_deviation": max((a - b).abs().max().item() for a, b in zip(weights["ieee"], weights["tf32"]))}


def _tf32_timed(tf32: bool, step, steps: int, device) -> float:
    set_tf32(tf32)
    return seconds_per_step(step, steps, device)


def tf32(bench: Bench) -> Outcome:
    size, batch_size, steps = GPT_SIZES["quick"], bench.pick(16, 32), bench.pick(5, 10)
    raw = bench.child(_tf32_child, size=size, batch_size=batch_size, steps=steps, rounds=bench.repeats(3, 5))
    what = f"gpt {size['n_layer']}x{size['n_embd']}, {batch_size}x{size['block_size']} tokens, float32"
    rows = [ratio_row(bench.entry, "TF32 off (IEEE)", "TF32 on", f"step time, {what}", raw["step_s"]["ieee"],
                      raw["step_s"]["tf32"]),
            value_row(bench.entry, "TF32 off (IEEE)", "TF32 on", "max abs logit difference, one forward",
                      [raw["logit_deviation"]], unit="abs"),
            value_row(bench.entry, "TF32 off (IEEE)", "TF32 on", f"max abs weight difference after {steps} SGD "
                      "steps", [raw["weight_deviation"]], unit="abs")]
    return Outcome(rows, raw, [f"Logits up to {raw['logit_max_abs']:.3g} in magnitude; TF32 keeps 10 mantissa bits "
                               "of float32's 23 in the matmul inputs (relative error ~1e-3 per product)."])


# name -> (function, what it measures). Order = run order.
ENTRIES = {
    "syncs": (syncs, "host syncs per training step for each loss-logging idiom and the real loop"),
    "copies": (copies, "host-to-device copies: pageable vs pinned + non_blocking"),
    "precision": (precision, "step time and memory: 32-true/tf32/bf16-mixed/16-mixed/16-o2, resnet18/50 (NCHW, "
                             "channels_last), gpt"),
    "cudnn_benchmark": (cudnn_benchmark, "cudnn.benchmark off vs on (resnet50, bf16-mixed)"),
    "gpt_compile_mfu": (gpt_compile_mfu, "torch.compile on/off and MFU of the gpt step vs the datasheet's and a "
                                         "measured bf16 peak"),
    "tf32": (tf32, "float32 gpt step time with TF32 matmuls off vs on, and the logit and weight deviation"),
    "cuda_graphs": (cuda_graphs, "gpt step time: eager vs torch.compile vs compile(mode='reduce-overhead') (CUDA "
                                 "graphs)"),
}
