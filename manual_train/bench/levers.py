"""Speed and memory levers, measured (docs/levers.md): the optimizer's implementation, activation checkpointing.

    optimizer_step_s(optimizer, impl, ...)       seconds per optimizer.step() of build_optimizer's optimizer
    LiveTensorBytes                              a dispatch mode counting the bytes of live tensors made by ops
    checkpointing_peak(model_name, mode, ...)    peak live tensor bytes and seconds of one forward + backward
    levers(bench)                                the CPU suite's entry (manual_train/bench/cpu.py registers it)
    compile_speed(bench)                         --compile none/model/blocks on --model gpt: steady samples/s and
                                                 compile time, side by side in one process (its own entry: slow)
    compile_pydoc(bench)                         the same on --dataset pydoc (real text): steady training tokens/s

Memory is counted in tensor bytes, not the process's RSS: glibc keeps freed memory, so RSS hardly moves when
checkpointing frees activations. LiveTensorBytes sees every tensor an operator returns (forward, backward and
the recompute inside backward alike), keeps each storage once and forgets it when the storage is freed (storage
objects are weakly referenceable and outlive their Python wrappers only while in use), so its peak is the most
activation, gradient and temporary bytes alive at once. Results that share an input's storage (views, detach,
in-place ops) are not new bytes and are not counted: checkpoint detaches its inputs, which would otherwise count
the block's input and weights again. Saved-tensor hooks would not do: checkpoint installs its
own, which hide the recompute from an outer hook.
"""
from __future__ import annotations

import functools
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from manual_train.config import COMPILE  # --compile's modes: none, model, blocks

MIB = 2 ** 20
IMPLS = ("for-loop", "foreach", "fused")


def deep_mlp(width: int, depth: int) -> torch.nn.Module:
    """The optimizer benchmark's model: many equal tensors (as ddp_knobs' step-time model)."""
    layers = [torch.nn.Linear(64, width)]
    for _ in range(depth - 1):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers)


def _optimizer(name: str, impl: str, params, lr: float = 1e-3):
    from manual_train.config import Config, parse_config
    from manual_train.optim import build_optimizer

    cfg: Config = parse_config(Config, ["--optimizer", name, "--optimizer-impl", impl, "--weight-decay", "0.01"])
    return build_optimizer(cfg, params, lr)


def optimizer_step_s(name: str, impl: str, width: int = 512, depth: int = 16, steps: int = 5) -> float:
    """Median seconds per step of --optimizer name with --optimizer-impl impl on deep_mlp's random gradients."""
    torch.manual_seed(0)
    model = deep_mlp(width, depth)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = _optimizer(name, impl, model.parameters())
    optimizer.step()  # state allocated outside the timing
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def optimizer_deviation(name: str, impl: str, steps: int = 10, dtype=torch.float32) -> float:
    """Max abs parameter difference between impl and for-loop after `steps` steps on the same gradients."""
    finals = []
    for which in ("for-loop", impl):
        torch.manual_seed(0)
        model = deep_mlp(64, 4).to(dtype)
        optimizer = _optimizer(name, which, model.parameters(), lr=0.01)
        grads = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=grads, dtype=dtype)
            optimizer.step()
        finals.append([p.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*finals))


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensors that operators returned while active and that are still alive; `peak` is the most."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # views, detach and in-place results share an input's storage: not new bytes
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.now -= self.live.pop(key, 0)


def checkpointing_peak(model_name: str, mode: str, batch: int = 16, repeats: int = 3) -> dict:
    """Peak live tensor bytes of one forward + backward (counted, once) and its median seconds (uncounted)."""
    from manual_train.models import DataInfo, build_model, loss_fn

    torch.manual_seed(0)
    if model_name == "gpt":  # a bigger GPT than --model gpt's, so that activations dominate
        info = DataInfo("reverse", (128,), 512, predict=64)
        x, y = torch.randint(0, 512, (batch, 128)), torch.randint(0, 512, (batch, 64))
    else:
        info = DataInfo("synthetic", (3, 32, 32), 10)
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    model = build_model(model_name, info, activation_checkpointing=mode)

    def step():
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (first-call allocations, lazy inits)
    with LiveTensorBytes() as counter:
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": counter.peak, "step_s": statistics.median(times)}


# ---------------------------------------------------------------------- the CPU suite's entry
def _optimizer_child(width: int, depth: int, steps: int, repeats: int) -> dict:
    from manual_train.bench.harness import interleave

    out = {}
    for name in ("sgd", "adamw"):
        variants = {impl: (lambda impl=impl: optimizer_step_s(name, impl, width, depth, steps)) for impl in IMPLS}
        out[name] = {"step_s": interleave(variants, repeats),
                     "deviation": {impl: optimizer_deviation(name, impl) for impl in IMPLS[1:]}}
    return out


def _checkpointing_child(batch: int, repeats: int) -> dict:
    out = {m: {mode: [] for mode in ("none", "full", "selective")} for m in ("gpt", "resnet18")}
    for _ in range(repeats):  # interleaved: none, full, selective, none, ...
        for m, modes in out.items():
            for mode, results in modes.items():
                results.append(checkpointing_peak(m, mode, batch))
    return out


def levers(bench):
    """Rows: optimizer step time per --optimizer-impl against for-loop, and its deviation; peak live tensor bytes
    and step time of --activation-checkpointing full/selective against none."""
    from manual_train.bench.harness import Goal, Outcome, ratio_row, value_row

    width, entry, rows, notes = bench.pick(256, 512), bench.entry, [], []
    opt = bench.child(_optimizer_child, width=width, depth=16, steps=bench.pick(3, 5), repeats=bench.repeats(2, 3))
    params = 64 * width + 15 * width * width
    for name, data in opt.items():
        times = data["step_s"]
        for impl in IMPLS[1:]:
            rows.append(ratio_row(entry, f"{name} for-loop", f"{name} {impl}", f"seconds per optimizer step (MLP "
                                  f"{width} x 16, {params / 1e6:.1f} M params)", times["for-loop"], times[impl],
                                  goal=Goal("<=", 0.5) if impl == "fused" else None))
            rows.append(value_row(entry, f"{name} for-loop", f"{name} {impl}", "max abs weight difference after 10 "
                                  "steps (fp32)", [data["deviation"][impl]], unit="abs",
                                  goal=Goal("<=", 0.0 if name == "sgd" else 1e-5)))
        notes.append(f"{name}: {statistics.median(times['for-loop']) * 1e3:.1f} ms per for-loop step")
    ckpt = bench.child(_checkpointing_child, batch=bench.pick(8, 16), repeats=bench.repeats(2, 3))
    for model_name, modes in ckpt.items():
        for mode in ("full", "selective"):
            base, var = modes["none"], modes[mode]
            rows.append(ratio_row(entry, f"{model_name} none", f"{model_name} {mode}", "peak live tensor bytes of "
                                  "forward + backward (dispatch-mode count)", [r["peak_bytes"] for r in base],
                                  [r["peak_bytes"] for r in var], goal=Goal("<=", 0.8) if mode == "full" else None))
            rows.append(ratio_row(entry, f"{model_name} none", f"{model_name} {mode}", "seconds per forward + "
                                  "backward (reported only)", [r["step_s"] for r in base], [r["step_s"] for r in var]))
        peaks = {mode: f"{modes[mode][0]['peak_bytes'] / MIB:.1f} MiB" for mode in modes}
        notes.append(f"{model_name}: peak {peaks['none']} without checkpointing, {peaks['full']} full, "
                     f"{peaks['selective']} selective")
    return Outcome(rows, {"optimizer": opt, "checkpointing": ckpt}, notes)


# ---------------------------------------------------------------------- --compile (its own entry: compiling is slow)
# the goal set when --compile blocks was added (per-block compile of the tiny GPT at 1.55x eager): stated, not a test
COMPILE_BLOCKS_GOAL = 1.55


def _train_step(model, optimizer, x, y) -> None:
    from manual_train.models import loss_fn

    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    optimizer.step()


def _compile_child(batch: int, steps: int, repeats: int, data_argv: tuple = (), batches: int = 1) -> dict:
    """--model gpt built as the loops build it (build_model_from, build_optimizer's fused AdamW) under each --compile
    mode, in one process: the first step's seconds (tracing and compiling forward and backward) and seconds per step
    after it, the modes interleaved. Inductor's on-disk caches are off, so each mode compiles from scratch, as a first
    run on a new machine does (blocks' graphs are new code to dynamo: the model's graph inlined Block.forward).
    The steps cycle through the first `batches` micro-batches of the loop's own loader (train_sampler's epoch-0
    order; `steps` a multiple of `batches`, so every timing sees each alike). data_argv: the dataset's flags
    (default: --dataset reverse, 4 batches of samples). targets_per_step: those micro-batches' mean real targets,
    counted by data.Windows, the count the loops weight and log with (text: padded targets excluded)."""
    import itertools

    import torch._inductor.config

    from manual_train import data
    from manual_train.bench.harness import interleave, seconds_per_step
    from manual_train.config import Config, parse_config
    from manual_train.models import build_model_from
    from manual_train.optim import build_optimizer

    torch._inductor.config.force_disable_caches = True
    cpu = torch.device("cpu")
    data_argv = data_argv or ("--dataset", "reverse", "--synthetic-size", str(4 * batch))
    flags = ["--model", "gpt", *data_argv, "--optimizer", "adamw", "--batch-size", str(batch)]
    cfg = parse_config(Config, flags)
    train_ds, _, info = data.build_datasets(cfg)
    sampler = data.train_sampler(train_ds, cfg.seed)
    sampler.set_epoch(0)
    loader = data.build_loader(train_ds, cfg, cpu, batch_size=batch, sampler=sampler)
    pairs = list(itertools.islice(loader, batches))
    windows = data.Windows(train_ds, sampler, cfg)
    targets = [windows.count(k)[0] for k in range(batches)]
    counts = data.target_counts(train_ds)
    measure, first_s = {}, {}
    for mode in COMPILE:
        cfg = parse_config(Config, [*flags, "--compile", mode])
        torch.manual_seed(0)
        model = build_model_from(cfg, info)
        optimizer = build_optimizer(cfg, model.parameters(), 1e-3)
        step = functools.partial(_cycle_step, model, optimizer, itertools.cycle(pairs))
        start = time.perf_counter()
        step()
        first_s[mode] = time.perf_counter() - start
        measure[mode] = functools.partial(seconds_per_step, step, steps, cpu)
    return {"step_s": interleave(measure, repeats), "first_step_s": first_s,
            "targets_per_step": statistics.mean(targets), "targets": targets,
            "epoch_targets_per_sample": (counts.double().mean().item() if counts is not None
                                         else windows.per_sample)}


def _cycle_step(model, optimizer, batches) -> None:
    _train_step(model, optimizer, *next(batches))


def _compile_rows(entry: str, raw: dict, rate: dict, what: str, goals: dict) -> list:
    """Per --compile mode: its steady rate against eager's (paired by repeat; higher is better), and its compile
    time, the first step's excess over a steady step."""
    from manual_train.bench.harness import Goal, ratio_row, value_row

    rows = []
    for mode in COMPILE[1:]:
        rows.append(ratio_row(entry, "eager", f"--compile {mode}", what, rate["none"], rate[mode], better="higher",
                              goal=Goal(">=", goals[mode]) if mode in goals else None))
        steady = statistics.median(raw["step_s"][mode])
        rows.append(value_row(entry, "-", f"--compile {mode}", "compile time: the first step's excess over a "
                              "steady step", [raw["first_step_s"][mode] - steady], unit="s"))
    return rows


def compile_speed(bench):
    """Rows: steady samples/s of --compile model and blocks against eager (goal for blocks: 1.55x),
    and the compile time: the first step's excess over a steady one."""
    from manual_train.bench.harness import Outcome

    batch = 32
    raw = bench.child(_compile_child, batch=batch, steps=bench.pick(10, 40), repeats=bench.repeats(3, 5),
                      timeout_s=1200)
    rate = {mode: [batch / t for t in raw["step_s"][mode]] for mode in COMPILE}
    what = f"steady samples/s, --model gpt --dataset reverse, batch {batch}"
    rows = _compile_rows(bench.entry, raw, rate, what, {"blocks": COMPILE_BLOCKS_GOAL})
    notes = ["steady samples/s: " + ", ".join(f"{mode} {statistics.median(rate[mode]):.0f}" for mode in COMPILE),
             f"Goal: --compile blocks {COMPILE_BLOCKS_GOAL}x eager's samples/s, set when the flag was added; "
             "--compile model is reported without a goal."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- --compile on real text (--dataset pydoc)
PYDOC_BATCHES = 4  # micro-batches the timed steps cycle through (128 samples of the epoch's order)


def compile_pydoc(bench):
    """Rows: steady training tokens/s of the GPT on --dataset pydoc under --compile model and blocks against eager,
    each mode's compile time, and the absolute tokens/s of all three. Tokens are real targets (a document's short
    last chunk pads its targets with -100, which the loss ignores and which are not counted), per data.Windows."""
    from manual_train.bench.harness import Outcome, value_row

    batch = 32
    raw = bench.child(_compile_child, batch=batch, steps=PYDOC_BATCHES * bench.pick(3, 8),
                      repeats=bench.repeats(3, 5), data_argv=("--dataset", "pydoc"), batches=PYDOC_BATCHES,
                      timeout_s=1200)
    tokens = raw["targets_per_step"]
    rate = {mode: [tokens / t for t in raw["step_s"][mode]] for mode in COMPILE}
    what = f"steady training tokens/s (real targets), --model gpt --dataset pydoc, batch {batch} x 64"
    rows = _compile_rows(bench.entry, raw, rate, what, {})
    rows += [value_row(bench.entry, "-", "eager" if mode == "none" else f"--compile {mode}", what, rate[mode],
                       unit="tok/s", better="higher") for mode in COMPILE]
    notes = ["steady tokens/s: " + ", ".join(f"{mode} {statistics.median(rate[mode]):,.0f}" for mode in COMPILE)
             + "; steady samples/s: " + ", ".join(f"{mode} {statistics.median(rate[mode]) * batch / tokens:.0f}"
                                                    for mode in COMPILE),
             f"Tokens: the real targets of the {PYDOC_BATCHES} micro-batches the steps cycle through (the loop's "
             f"first of epoch 0, counted by data.Windows as loops.single counts them): {tokens:.1f} per step of "
             f"{batch * 64} positions; the epoch's mean is {raw['epoch_targets_per_sample']:.2f} per sample. Padded "
             "positions cost the same compute, so tokens/s = real targets per step / seconds per step."]
    return Outcome(rows, raw, notes)
