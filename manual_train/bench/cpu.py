"""CPU entries: what each technique buys on this machine's CPU (`python -m manual_train.bench --suite cpu`).

Each entry is one function `entry(bench) -> Outcome` listed in ENTRIES at the bottom; the functions
whose names start with `_` and end in `_child` run inside fresh processes (harness.Bench.child) and
return plain numbers. Where an entry measures a project technique it runs the project's code
(loops.single.train through its CLI config, data.build_loader, evaluation.evaluate); only the
baselines that the project deliberately does not contain (a 10-line loop, grad-enabled evaluation,
the retained-graph logging anti-pattern) are written here.

Adding an entry: write one function that returns an Outcome and add it to ENTRIES (zero_memory was
added that way when manual_train/zero.py landed).
"""
from __future__ import annotations

import csv
import functools
import tempfile
import time
from pathlib import Path

from manual_train.bench.checkpoint_io import checkpoint_io_entry
from manual_train.bench.ddp_knobs import ddp_knobs
from manual_train.bench.harness import (Bench, Goal, Outcome, StepClock, interleave, median, mib, ratio_row,
                                        single_config, train_single, value_row)
from manual_train.bench.levers import compile_pydoc, compile_speed, levers
from manual_train.bench.speedups import speedups_vs_naive
from manual_train.bench.tensor_parallel import tensor_parallel_entry
from manual_train.bench.time_to_target import time_to_target

# What the two source articles (docs/benchmarks.md quotes them) promise, per technique.
CLAIM_WORKERS = "num_workers = CPU count (art. 2); num_workers=10 is the fast way (art. 1)"
CLAIM_LOGGING = "losses.append(loss) keeps the graph and blows up memory (art. 1)"
CLAIM_NO_GRAD = "no_grad stores no activations: less memory, bigger batches, faster eval (art. 2)"
CLAIM_ACCUM = "accumulation gives a big batch's gradient in limited memory (art. 1)"
CLAIM_EARLY = "stop after 10 evaluations without improvement; best model within tens of epochs (art. 2)"
CLAIM_AMP = "mixed precision 1.5-2x faster (art. 2), half the memory (art. 1) - on GPUs"


# ---------------------------------------------------------------------- shared helpers (run in children)
def _csv_window_s(metrics_csv: Path, first: int, last: int) -> float:
    """Seconds between the train rows logged at optimizer steps `first` and `last` (the loop's own clock)."""
    with open(metrics_csv) as f:
        times = {int(r["step"]): float(r["time_s"]) for r in csv.DictReader(f) if r["split"] == "train"}
    return times[last] - times[first]


def _digits_tensors():
    from manual_train import data

    train_ds, _, info = data.build_datasets(single_config("--dataset", "digits"))
    return train_ds.tensors, info


# ---------------------------------------------------------------------- loop overhead
# Both loops run the same epoch: the same SeededLoader over the same sampler (so the same batches, collated the same
# way), the same initial weights, optimizer, learning rate and LR schedule; the bare loop leaves out only what is
# the loop's own (accumulation weights, the AMP calls, the running sums, logging, Run's calls). The clock is the
# process's CPU time, read by a global optimizer-step hook in both (the same few instructions in each): CPU time
# does not count the time another process holds the core, which wall time on a shared 2-core machine does.
LOOP_CASES = {  # name -> (flags, first step, last step): the window lies inside epoch 1 (no evaluation in it)
    "mlp": (("--model", "mlp", "--dataset", "digits", "--batch-size", "8", "--epochs", "1", "--log-every", "10"),
            20, 180),
    "mlp --no-train-acc": (("--model", "mlp", "--dataset", "digits", "--batch-size", "8", "--epochs", "1",
                            "--no-train-acc", "--log-every", "10"), 20, 180),
    "cnn": (("--model", "cnn", "--dataset", "digits", "--batch-size", "32", "--epochs", "1", "--log-every", "10"),
            5, 45),
}
LOOP_GOALS = {"mlp": 1.10, "mlp --no-train-acc": 1.05, "cnn": 1.02}


def _ours_step_s(case: str) -> float:
    argv, first, last = LOOP_CASES[case]
    clock = StepClock(first, last, int(argv[-1]))
    with tempfile.TemporaryDirectory() as tmp:
        train_single(Path(tmp) / "run", *argv)
    return clock.per_step_s()


def _bare_setup(case: str):
    """The loader, initial weights, optimizer and LR schedule loops.single.train uses, built the same way."""
    import torch

    from manual_train import data
    from manual_train.models import build_model_from
    from manual_train.optim import build_optimizer, build_scheduler, scaled_lr

    cfg = single_config(*LOOP_CASES[case][0])
    train_ds, _, info = data.build_datasets(cfg)
    sampler = data.train_sampler(train_ds, cfg.seed)
    sampler.set_epoch(0)
    loader = data.build_loader(train_ds, cfg, torch.device("cpu"), batch_size=cfg.batch_size, sampler=sampler)
    torch.manual_seed(cfg.seed)
    model = build_model_from(cfg, info)
    optimizer = build_optimizer(cfg, model.parameters(), scaled_lr(cfg, cfg.batch_size))
    return loader, model, optimizer, build_scheduler(cfg, optimizer, cfg.epochs * len(loader))


def _bare_step_s(case: str) -> float:
    from manual_train.models import loss_fn

    argv, first, last = LOOP_CASES[case]
    loader, model, optimizer, scheduler = _bare_setup(case)
    clock = StepClock(first, last, int(argv[-1]))
    # The bare loop: forward, backward, step, schedule. No accumulation, precision, logging or eval.
    for step, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step == last:
            return clock.per_step_s()
    raise RuntimeError(f"the epoch ended before step {last}")


def _lightning_module():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _lightning_step_s(case: str) -> float:
    """The same work through Lightning's Trainer (its optimizer.step passes the same hook)."""
    from manual_train.models import loss_fn

    pl = _lightning_module()
    argv, first, last = LOOP_CASES[case]
    loader, model, optimizer, scheduler = _bare_setup(case)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.model(x), y)

        def configure_optimizers(self):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    clock = StepClock(first, last, int(argv[-1]))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=last, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0)
    trainer.fit(Module(), train_dataloaders=loader)
    return clock.per_step_s()


def _loop_overhead_child(repeats: int, cases: tuple) -> dict:
    import torch

    torch.set_num_threads(1)  # one thread: CPU time is then the step's own work, not idle spinning of a pool
    variants = {}
    for case in cases:
        variants[f"{case}/ours"] = functools.partial(_ours_step_s, case)
        variants[f"{case}/bare"] = functools.partial(_bare_step_s, case)
        try:
            _lightning_module()
            variants[f"{case}/lightning"] = functools.partial(_lightning_step_s, case)
        except ImportError:
            pass
    return interleave(variants, repeats, warmup=1)


def loop_overhead(bench: Bench) -> Outcome:
    raw = bench.child(_loop_overhead_child, repeats=bench.repeats(7, 15), cases=tuple(LOOP_CASES))
    rows, notes = [], []
    for case, (argv, first, last) in LOOP_CASES.items():
        metric = f"CPU time per step, steps {first + 1}-{last} ({case}, digits, batch {argv[5]}, one thread)"
        ours, bare = raw[f"{case}/ours"], raw[f"{case}/bare"]
        rows.append(ratio_row(bench.entry, "10-line bare loop", "loops.single.train", metric, bare, ours,
                              claim="(no number claimed)", goal=Goal("<=", LOOP_GOALS[case])))
        notes.append(f"{case}: ours - bare = {(median(ours) - median(bare)) * 1e6:.1f} us per step "
                     f"(bare {median(bare) * 1e6:.0f} us)")
        if f"{case}/lightning" in raw:
            rows.append(ratio_row(bench.entry, "Lightning Trainer.fit", "loops.single.train", metric,
                                  raw[f"{case}/lightning"], ours,
                                  claim="Lightning automates these speed-ups (art. 1, 2)",
                                  goal=Goal("<=", 0.5) if case == "mlp" else None))
    notes += ["Both loops see the same batches (one SeededLoader over the same sampler), weights, optimizer and "
              "LR schedule; ours adds accumulation weights, the AMP calls (no-ops in 32-true), the detached "
              "losses and argmax predictions kept on the device and Run's calls, with a CSV row and host sync "
              "every 10 steps. "
              "docs/loop_overhead.md has the per-step breakdown.",
              "Read the mlp's row beside the load average in bench.json: on 2026-12-01 it was 1.28 (spread "
              "1.23-1.28, 5 repeats, the whole window's CPU time) on a quiet machine (load 0.4), and medians of "
              "1.13-1.46 with spreads up to 1.02-1.66 at load 5-10: other processes evict the caches between "
              "time slices, which CPU time still counts."]
    if not any(k.endswith("/lightning") for k in raw):
        notes.append("ours/Lightning not measured: pytorch-lightning is not installed here "
                     "(pip install -e '.[compare]' adds it).")
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- data loading
class EncodedImages:
    """A CPU-bound dataset: JPEG bytes decoded and augmented (torchvision transforms) per sample.

    What an ImageNet-style loader does per sample, minus the disk: decode, random resized crop, flip,
    convert and normalise. Images are smooth random fields (noise would not compress like photos).
    """

    def __init__(self, size: int, side: int = 96, crop: int = 64, seed: int = 0):
        import torch
        import torch.nn.functional as F
        from torchvision.io import encode_jpeg
        from torchvision.transforms import v2 as T

        g = torch.Generator().manual_seed(seed)
        self.blobs = []
        for _ in range(size):
            coarse = torch.rand(1, 3, side // 8, side // 8, generator=g)
            image = F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)[0]
            self.blobs.append(encode_jpeg((image * 255).to(torch.uint8), quality=90))
        self.transform = T.Compose([T.RandomResizedCrop(crop, antialias=True), T.RandomHorizontalFlip(),
                                    T.ToDtype(torch.float32, scale=True),
                                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int):
        from torchvision.io import decode_jpeg

        return self.transform(decode_jpeg(self.blobs[i])), i % 10


def _epoch_throughput(loader, samples: int) -> float:
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return samples / (time.perf_counter() - t0)


def _loader_child(kind: str, workers: tuple, samples: int, batch_size: int, latency_s: float, repeats: int) -> dict:
    import torch
    from torch.utils.data import Subset

    from manual_train import data

    if kind == "io":
        (x, y), _ = _digits_tensors()
        dataset = data.SlowReads(Subset(torch.utils.data.TensorDataset(x, y), range(samples)), latency_s)
    else:
        dataset = EncodedImages(samples)
    loaders = {}
    for w in workers:
        # persistent workers: the timed epochs measure loading, not forking; the warm-up round starts them
        cfg = single_config("--num-workers", str(w), *(["--persistent-workers"] if w else []))
        loaders[f"workers={w}"] = data.build_loader(dataset, cfg, torch.device("cpu"), batch_size=batch_size)
    result = interleave({name: functools.partial(_epoch_throughput, loader, samples)
                         for name, loader in loaders.items()}, repeats, warmup=1)
    del loaders  # shuts the worker processes down before the child reports
    return result


def data_io(bench: Bench) -> Outcome:
    latency_s, samples, workers = 0.002, bench.pick(512, 1024), (0, 2, 4)
    raw = bench.child(_loader_child, kind="io", workers=workers, samples=samples, batch_size=32,
                      latency_s=latency_s, repeats=bench.repeats(3, 7))
    metric = f"samples/s, data.SlowReads {latency_s * 1000:g} ms/sample, batch 32"
    rows = [ratio_row(bench.entry, "num_workers=0", f"num_workers={w}", metric, raw["workers=0"], raw[f"workers={w}"],
                      better="higher", claim=CLAIM_WORKERS, goal=Goal(">=", 3.2) if w == 4 else None)
            for w in workers[1:]]
    notes = ["The read latency is a sleep, so workers overlap it without using CPU: the I/O-bound case, where "
             "workers pay off even on 2 cores."]
    return Outcome(rows, raw, notes)


def data_cpu(bench: Bench) -> Outcome:
    samples, workers = bench.pick(384, 1024), (0, 2, 4)
    raw = bench.child(_loader_child, kind="decode", workers=workers, samples=samples, batch_size=32,
                      latency_s=0.0, repeats=bench.repeats(3, 5))
    metric = "samples/s, JPEG decode + RandomResizedCrop + flip + normalise"
    rows = [ratio_row(bench.entry, "num_workers=0", f"num_workers={w}", metric, raw["workers=0"], raw[f"workers={w}"],
                      better="higher", claim=CLAIM_WORKERS) for w in workers[1:]]
    notes = ["CPU-bound loading can only go as fast as the free cores: reported, with no goal, on a 2-core "
             "machine shared with other work."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- loss logging
LOG_VARIANTS = {
    "append": "losses.append(loss)",
    "sum": "total = total + loss",
    "item": "losses.append(loss.item())",
    "ours": "ours: sum of loss.detach(), .item() every 10 steps",
}


def _logging_growth_child(variant: str, steps: int, warmup: int, sample_every: int, log_every: int) -> dict:
    """RSS over `steps` training steps that log the loss the `variant` way; slope by least squares."""
    import torch

    from manual_train.bench.harness import rss_bytes
    from manual_train.models import build_model, loss_fn
    from manual_train.optim import build_optimizer

    (x_all, y_all), info = _digits_tensors()
    torch.manual_seed(0)
    model = build_model("mlp", info)
    optimizer = build_optimizer(single_config(), model.parameters(), 0.05)
    batch = 32
    kept = []  # whatever the logging holds on to
    total = [torch.zeros(())]
    loss_sum = torch.zeros(())

    def step(i: int) -> None:
        nonlocal loss_sum
        j = (i * batch) % (len(y_all) - batch)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x_all[j:j + batch]), y_all[j:j + batch])
        loss.backward()
        optimizer.step()
        if variant == "append":
            kept.append(loss)  # the tensor keeps its grad_fn, and through it the step's autograd graph
        elif variant == "sum":
            total[0] = total[0] + loss  # each sum is a new node chained to every earlier step's graph
        elif variant == "item":
            kept.append(loss.item())  # a Python float: nothing retained, but a host sync every step on GPUs
        else:
            loss_sum += loss.detach()  # as loops.single: no graph, no sync
            if (i + 1) % log_every == 0:
                kept.append(loss_sum.item() / log_every)
                loss_sum = torch.zeros(())

    for i in range(warmup):
        step(i)
    kept.clear()
    total[0] = torch.zeros(())
    samples = []
    for i in range(steps):
        step(i)
        if (i + 1) % sample_every == 0:
            samples.append((i + 1, rss_bytes()))
    n = len(samples)
    mean_s = sum(s for s, _ in samples) / n
    mean_r = sum(r for _, r in samples) / n
    slope = (sum((s - mean_s) * (r - mean_r) for s, r in samples) / sum((s - mean_s) ** 2 for s, _ in samples))
    return {"slope_bytes_per_step": slope, "growth_bytes": slope * steps, "rss_samples": samples}


def _loop_growth_child(short_steps: int, long_steps: int) -> dict:
    """Peak RSS that loops.single.train adds in a short and a long run: the difference is what it keeps."""
    from manual_train.bench.harness import peak_rss_delta

    args = ("--model", "mlp", "--batch-size", "32", "--log-every", "10", "--early-stop-patience", "0")
    with tempfile.TemporaryDirectory() as tmp:
        train_single(Path(tmp) / "warmup", *args, "--max-steps", "20")
        _, short = peak_rss_delta(lambda: train_single(Path(tmp) / "short", *args, "--max-steps", str(short_steps)))
        _, long = peak_rss_delta(lambda: train_single(Path(tmp) / "long", *args, "--max-steps", str(long_steps)))
    return {"short_peak_delta_bytes": short, "long_peak_delta_bytes": long}


def loss_logging(bench: Bench) -> Outcome:
    steps, repeats = 500, bench.repeats(1, 3)
    raw = {v: [] for v in LOG_VARIANTS}
    raw["loop"] = []
    for _ in range(repeats):  # interleaved: each variant once per round, each in a fresh process
        for variant in LOG_VARIANTS:
            raw[variant].append(bench.child(_logging_growth_child, variant=variant, steps=steps, warmup=50,
                                            sample_every=10, log_every=10))
        raw["loop"].append(bench.child(_loop_growth_child, short_steps=50, long_steps=steps))
    entry, base = bench.entry, "(memory before the steps)"
    rows = [value_row(entry, base, LOG_VARIANTS[v], "RSS growth per step, mlp on digits",
                      [mib(r["slope_bytes_per_step"]) for r in raw[v]], unit="MB/step", claim=CLAIM_LOGGING)
            for v in ("append", "sum")]
    rows += [value_row(entry, base, LOG_VARIANTS[v], f"RSS growth over {steps} steps (fitted)",
                       [mib(r["growth_bytes"]) for r in raw[v]], unit="MB", claim=CLAIM_LOGGING,
                       goal=Goal("<=", 1.0) if v == "ours" else None) for v in ("item", "ours")]
    loop_growth = [mib(r["long_peak_delta_bytes"] - r["short_peak_delta_bytes"]) for r in raw["loop"]]
    rows.append(value_row(entry, "loops.single.train, 50 steps", f"loops.single.train, {steps} steps",
                          "extra peak RSS of the longer run", loop_growth, unit="MB", claim=CLAIM_LOGGING,
                          goal=Goal("<=", 1.0)))
    notes = ["With backward() every step the retained graph holds autograd nodes, not activations (backward "
             "frees saved tensors): the anti-pattern leaks kilobytes per step, which is gigabytes over a long run. "
             "Appending an undetached loss where no backward runs (e.g. validation without no_grad) keeps "
             "every activation as well."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- evaluation
def evaluate_with_grad(model, loader, device):
    """evaluation.evaluate without its no_grad/inference_mode context: the baseline users get by forgetting it.

    The sums take .detach(): without it every batch's graph stays chained to loss_sum (the loss_logging
    anti-pattern), and memory would grow with the number of batches rather than the batch size.
    """
    import torch
    import torch.nn.functional as F

    from manual_train.models import correct_count

    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum").detach()
        correct += correct_count(logits, y)
        count += y.numel()
    return loss_sum, correct, count


EVAL_ARGS = ("--dataset", "synthetic", "--synthetic-shape", "3,32,32", "--model", "cnn")


def _eval_child(mode: str, samples: int, batch_size: int) -> dict:
    import torch
    from torch.utils.data import TensorDataset

    from manual_train import data
    from manual_train.bench.harness import peak_rss_delta
    from manual_train.evaluation import evaluate
    from manual_train.models import build_model
    from manual_train.precision import autocast_for

    cpu = torch.device("cpu")
    cfg = single_config(*EVAL_ARGS, "--synthetic-size", str(4 * samples), "--eval-batch-size", str(batch_size))
    _, val_ds, info = data.build_datasets(cfg)
    # materialised up front, so the timed pass measures the model, not SyntheticImages' generator
    xs, ys = zip(*(val_ds[i] for i in range(len(val_ds))))
    loader = data.build_loader(TensorDataset(torch.stack(xs), torch.tensor(ys)), cfg, cpu, batch_size=batch_size)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, info)
    if mode == "grad":
        run = functools.partial(evaluate_with_grad, model, loader, cpu)
    else:
        run = functools.partial(evaluate, model, loader, cpu, autocast_for(cfg.precision, cpu), mode)
    run()  # warm-up: kernels and thread pools initialised outside the measurement
    t0 = time.perf_counter()
    (loss_sum, _, count), delta = peak_rss_delta(run)
    return {"time_s": time.perf_counter() - t0, "peak_delta_bytes": delta, "val_loss": (loss_sum / count).item()}


EVAL_MODES = {"grad": "grad-enabled", "no_grad": "torch.no_grad", "inference": "torch.inference_mode"}


def evaluation(bench: Bench) -> Outcome:
    samples, batch_size = bench.pick(512, 1024), 256
    raw = {m: [] for m in EVAL_MODES}
    for _ in range(bench.repeats(3, 5)):
        for mode in EVAL_MODES:
            raw[mode].append(bench.child(_eval_child, mode=mode, samples=samples, batch_size=batch_size))

    def column(mode, key):
        return [r[key] for r in raw[mode]]

    entry, what = bench.entry, f"cnn, synthetic 3x32x32, {samples} samples, batch {batch_size}"
    rows = [
        ratio_row(entry, "grad-enabled", "evaluation.evaluate (no_grad)", f"peak RSS added ({what})",
                  column("grad", "peak_delta_bytes"), column("no_grad", "peak_delta_bytes"), claim=CLAIM_NO_GRAD,
                  goal=Goal("<=", 0.5)),
        ratio_row(entry, "grad-enabled", "evaluation.evaluate (inference_mode)", "peak RSS added",
                  column("grad", "peak_delta_bytes"), column("inference", "peak_delta_bytes"), claim=CLAIM_NO_GRAD),
        ratio_row(entry, "grad-enabled", "evaluation.evaluate (no_grad)", "time of one pass",
                  column("grad", "time_s"), column("no_grad", "time_s"), claim=CLAIM_NO_GRAD),
        ratio_row(entry, "no_grad", "inference_mode", "time of one pass",
                  column("no_grad", "time_s"), column("inference", "time_s")),
    ]
    notes = ["Memory: peak RSS above the pass's starting RSS, in a fresh process after a warm-up pass, with "
             "glibc's malloc set to return freed blocks to the OS (see harness.py); equal val_loss in every "
             "mode checks that the three passes computed the same thing."]
    losses = {m: column(m, "val_loss")[0] for m in EVAL_MODES}
    if max(losses.values()) - min(losses.values()) > 1e-5:
        notes.append(f"WARNING: the modes disagree on val_loss: {losses}")
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- gradient accumulation
ACCUM_ARGS = ("--dataset", "synthetic", "--synthetic-size", "256", "--synthetic-shape", "3,32,32", "--model", "cnn",
              "--eval-batch-size", "16", "--early-stop-patience", "0", "--log-every", "1")


def _accumulation_child(batch_size: int, accumulate: int, steps: int) -> dict:
    from manual_train.bench.harness import peak_rss_delta

    args = (*ACCUM_ARGS, "--batch-size", str(batch_size), "--accumulate", str(accumulate))
    with tempfile.TemporaryDirectory() as tmp:
        train_single(Path(tmp) / "warmup", *args, "--max-steps", "1")
        summary, delta = peak_rss_delta(lambda: train_single(Path(tmp) / "run", *args, "--max-steps", str(steps)))
    return {"peak_delta_bytes": delta, "final_val_loss": summary["final_val_loss"]}


ACCUM_CONFIGS = {"64x1": (64, 1), "16x4": (16, 4), "1x64": (1, 64)}


def accumulation(bench: Bench) -> Outcome:
    raw = {name: [] for name in ACCUM_CONFIGS}
    for _ in range(bench.repeats(2, 3)):
        for name, (b, k) in ACCUM_CONFIGS.items():
            raw[name].append(bench.child(_accumulation_child, batch_size=b, accumulate=k, steps=2))
    peak = {name: [r["peak_delta_bytes"] for r in runs] for name, runs in raw.items()}
    entry, what = bench.entry, "loops.single.train, cnn, synthetic 3x32x32, global batch 64"
    rows = [
        ratio_row(entry, "batch 64", "batch 16 x accumulate 4", f"peak RSS added by the run ({what})",
                  peak["64x1"], peak["16x4"], claim=CLAIM_ACCUM, goal=Goal("<=", 0.35)),
        ratio_row(entry, "batch 64", "batch 1 x accumulate 64", "peak RSS added by the run", peak["64x1"],
                  peak["1x64"], claim=CLAIM_ACCUM),
    ]
    notes = ["The run's whole added peak is compared, weights, optimizer state and evaluation included, so the "
             "ratio is an upper bound on the activation ratio (ideal: 1/K). The runs take the same optimizer steps "
             "to the same weights (tests/test_accumulation.py proves it to ~1e-8).",
             "added peak RSS, MB (64x1 / 16x4 / 1x64): " + " / ".join(f"{mib(peak[n][0]):.1f}" for n in ACCUM_CONFIGS)
             + "; final val_loss: " + " / ".join(f"{raw[n][0]['final_val_loss']:.6f}" for n in ACCUM_CONFIGS)]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- early stopping
def _early_stopping_child(epochs: int, patience: int, repeats: int) -> dict:
    args = ("--model", "mlp", "--dataset", "digits", "--epochs", str(epochs))
    tmp = tempfile.TemporaryDirectory()
    counter = iter(range(10 ** 6))

    def run(patience_: int) -> dict:
        s = train_single(Path(tmp.name) / f"run{next(counter)}", *args, "--early-stop-patience", str(patience_))
        return {k: s[k] for k in ("wall_s", "epochs_run", "best_epoch", "best_val_loss", "stopped_early")}

    train_single(Path(tmp.name) / "warmup", "--model", "mlp", "--dataset", "digits", "--epochs", "1")  # first-call costs
    result = interleave({"fixed": functools.partial(run, 0), "early": functools.partial(run, patience)},
                        repeats, warmup=0)
    tmp.cleanup()
    return result


def early_stopping(bench: Bench) -> Outcome:
    epochs, patience = 40, 10
    raw = bench.child(_early_stopping_child, epochs=epochs, patience=patience, repeats=bench.repeats(2, 3))
    fixed, early = raw["fixed"], raw["early"]
    entry, base, var = bench.entry, f"fixed {epochs} epochs", f"--early-stop-patience {patience}"
    rows = [
        ratio_row(entry, base, var, "wall time of the run (mlp, digits, cosine LR)", [r["wall_s"] for r in fixed],
                  [r["wall_s"] for r in early], claim=CLAIM_EARLY),
        value_row(entry, base, var, "epochs run", [r["epochs_run"] for r in early], unit="epochs", claim=CLAIM_EARLY),
        value_row(entry, base, var, "best val_loss, early minus fixed",
                  [e["best_val_loss"] - f["best_val_loss"] for e, f in zip(early, fixed)], claim=CLAIM_EARLY),
    ]
    notes = [f"best epoch (1-based): early {early[0]['best_epoch']}, fixed {fixed[0]['best_epoch']}; both "
             f"runs share the LR schedule (cosine over {epochs} epochs), so the early run is a prefix of the "
             "fixed one."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- precision on the CPU
PRECISION_ARGS = ("--dataset", "synthetic", "--synthetic-size", "640", "--synthetic-shape", "3,16,16", "--model", "cnn",
                  "--batch-size", "16", "--log-every", "2", "--early-stop-patience", "0")


def _precision_window_s(precision: str, first: int, last: int) -> float:
    """One run's steps first+1..last: 16-o2 in its own loop (loops/apex_o2.py), the others in loops/single.py."""
    from manual_train.config import O2_PRECISIONS, parse_config
    from manual_train.loops import apex_o2
    from manual_train.apex_o2 import ApexO2Config

    argv = (*PRECISION_ARGS, "--precision", precision, "--max-steps", str(last))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        if precision in O2_PRECISIONS:
            apex_o2.train(parse_config(ApexO2Config, [*argv, "--no-progress", "--out-dir", str(run_dir)]))
        else:
            train_single(run_dir, *argv)
        return _csv_window_s(run_dir / "metrics.csv", first, last)


def _precision_cpu_child(precisions: tuple, repeats: int, first: int, last: int) -> dict:
    # no warm-up round: the window starts after the first steps of each run, which pay the first-call costs
    return interleave({p: functools.partial(_precision_window_s, p, first, last) for p in precisions},
                      repeats, warmup=0)


def precision_cpu(bench: Bench) -> Outcome:
    precisions = ("32-true", "bf16-mixed", "16-mixed", "16-o2")
    first, last = 2, 6
    raw = bench.child(_precision_cpu_child, precisions=precisions, repeats=bench.repeats(2, 5), first=first, last=last)
    metric = f"time of steps {first + 1}-{last} (cnn, synthetic 3x16x16, batch 16)"
    rows = [ratio_row(bench.entry, "32-true", p, metric, raw["32-true"], raw[p], claim=CLAIM_AMP)
            for p in precisions[1:]]
    notes = ["This CPU (AVX2, no AVX512-BF16/AMX) has no 16-bit matrix units: 16-bit math is emulated or "
             "converted, so reported only; the GPU suite measures what the articles meant."]
    return Outcome(rows, raw, notes)


# ---------------------------------------------------------------------- ZeRO: bytes held per rank
ZERO_CONFIGS = (("ddp", 0), ("torch", 1), ("torch", 2), ("torch", 3), ("fairscale", 1), ("fairscale", 2))


def _zero_child(world_sizes: tuple, configs: tuple) -> dict:
    from manual_train.bench.zero_memory import measure_per_rank_bytes

    # measure_per_rank_bytes starts N gloo processes, takes one AdamW step of each config in them and reads the
    # storage each rank holds afterwards (manual_train/memory.py: per_rank_bytes)
    # fork: the ranks start from this fresh process (torch already imported) instead of 4 new pythons
    return {str(n): measure_per_rank_bytes(n, "cnn", "adamw", configs=configs, start_method="fork")
            for n in world_sizes}


def zero_memory(bench: Bench) -> Outcome:
    import importlib.util

    configs, notes = ZERO_CONFIGS, []
    if importlib.util.find_spec("fairscale") is None:
        configs = tuple(c for c in configs if c[0] != "fairscale")
        notes.append("fairscale is not installed, so its rows (OSS, OSS + ShardedDDP) are missing "
                     "(pip install -e '.[zero]').")
    raw = bench.child(_zero_child, world_sizes=(2, 4), configs=configs)
    rows = []
    for n, result in raw.items():
        ddp, kb = result["rows"][0], 1024
        for r in result["rows"]:
            measured = "/".join(f"{max(x[k] for x in r['per_rank']) / kb:.0f}"
                                for k in ("params", "grads", "optimizer_state"))
            formula = "/".join(f"{r['formula'][k] / kb:.0f}" for k in ("params", "grads", "optimizer_state"))
            held = max(x["params_after_forward"] for x in r["per_rank"]) / kb
            notes.append(f"N={n} {r['impl']} stage {r['stage']}: params/grads/AdamW state per rank, KB (largest "
                         f"rank): measured {measured}, paper's formula {formula}; parameters held between forward "
                         f"and backward {held:.0f}")
            if r is ddp:
                continue
            predicted = r["formula"]["total"] / ddp["formula"]["total"]
            rows.append(ratio_row(bench.entry, "DDP", f"{r['impl']} stage {r['stage']}, N={n}",
                                  f"per-rank bytes, params + grads + AdamW state (cnn, {result['psi']:,} params)",
                                  [x["total"] for x in ddp["per_rank"]],
                                  [x["total"] for x in r["per_rank"]], claim=f"ZeRO paper's formula: {predicted:.3f}"))
    notes.append("Storage held between steps, one value per rank, counted by "
                 "manual_train.memory.per_rank_bytes (communication buckets and activations are not in "
                 "it). fairscale's OSS shards whole tensors, so its ranks differ; torch's stage 2 (FSDP2, "
                 "reshard_after_forward=False) reshards after backward, so between steps it holds what stage 3 "
                 "holds and differs only between forward and backward.")
    return Outcome(rows, raw, notes)


# name -> (function, what it measures). Order = run order; cheap entries first.
def pipeline_bubble(bench: Bench) -> Outcome:
    """GPipe's idle time per stage (manual_train/bench/pipeline.py: 2 gloo processes, the hand-written schedule)
    against the formula (p-1)/(m+p-1), for m = 1, 2, 4, 8 micro-batches."""
    from manual_train.bench.pipeline import bubble_rows

    raw = bubble_rows(steps=bench.pick(3, 5))
    rows = [value_row(bench.entry, "formula", f"GPipe, {r['stages']} stages, m={r['microbatches']}",
                      "idle fraction of each stage's step time", r["idle_fraction_per_stage"],
                      claim=f"(p-1)/(m+p-1) = {r['formula']:.3f}") for r in raw]
    notes = ["Idle = time a stage waits in recv (fill and drain) over its step time, averaged over the stages. At "
             "m = 1, 2 it is near the formula; at larger m gloo's per-message cost on a 2-core CPU dominates "
             "(measured 2026-12-01: 0.29-0.36 at m = 4, 8 against 0.20, 0.11), and the stages are uneven "
             "(embeddings on one, head and loss on the other)."]
    return Outcome(rows, {"rows": raw}, notes)


ENTRIES = {
    "data_io": (data_io, "num_workers 0/2/4 on an I/O-bound dataset (data.SlowReads)"),
    "loop_overhead": (loop_overhead, "CPU time per step of loops.single.train vs a 10-line loop (mlp b8, cnn b32; "
                                     "and Lightning, if installed)"),
    "loss_logging": (loss_logging, "memory growth: losses.append(loss) / undetached sums vs detach + .item()"),
    "evaluation": (evaluation, "grad-enabled vs no_grad vs inference_mode: peak memory and time"),
    "accumulation": (accumulation, "peak memory: batch 64 vs 16 x accumulate 4 (vs 1 x 64)"),
    "early_stopping": (early_stopping, "wall time and epochs: fixed budget vs patience 10"),
    "data_cpu": (data_cpu, "num_workers 0/2/4 on a CPU-bound dataset (JPEG decode + augment); reported only"),
    "precision_cpu": (precision_cpu, "step time of 32-true vs bf16-mixed / 16-mixed / 16-o2 on the CPU; reported only"),
    "zero_memory": (zero_memory, "per-rank bytes of DDP and each ZeRO stage at N = 2, 4 vs the paper's formula"),
    "ddp_knobs": (ddp_knobs, "gradient bytes with/without bucket views, bytes per step per --comm-hook, step time vs "
                             "bucket cap and the other DDP knobs"),
    "levers": (levers, "optimizer step time per --optimizer-impl vs for-loop (and deviation); peak live tensor "
                       "bytes and step time per --activation-checkpointing vs none"),
    "compile": (compile_speed, "steady samples/s of the gpt: eager vs --compile model vs blocks, and compile time"),
    "compile_pydoc": (compile_pydoc, "steady training tokens/s of the gpt on --dataset pydoc (real targets): eager vs "
                                     "--compile model vs blocks, and compile time"),
    "pipeline_bubble": (pipeline_bubble, "GPipe idle fraction per stage vs (p-1)/(m+p-1), m = 1, 2, 4, 8"),
    "tensor_parallel": (tensor_parallel_entry, "TP and 2-D: bytes held per rank and sent per step vs the formulas"),
    "checkpoint_io": (checkpoint_io_entry, "seconds a save blocks the loop: pt vs dcp, sync vs --async-checkpoint"),
    "speedups_vs_naive": (speedups_vs_naive, "every CPU-applicable speed-up on vs a 10-line naive loop: GPT, cnn"),
    "time_to_target": (time_to_target, "seconds to val_acc 0.95 (cnn, 28x28 digits): naive loop vs defaults vs tuned"),
}
