"""Bench entry speedups_vs_naive: every CPU-applicable speed-up on, against the 10-line loop people write first.

The naive loop (below, `_naive_step_s`) is what a tutorial shows: a plain DataLoader, torch.optim's for-loop
optimizer (foreach=False, fused=False), eager modules, and `loss.item()` appended to a list every step. The other
side is loops.single.train through the project's own flags (docs/levers.md), each where it helps on this machine:

  --compile model             GPT only: 17-20% off its eager step here (docs/levers.md: blocks gave 1.00x); the cnn
                              runs eager (compile is measured on the GPT alone, docs/levers.md)
  --optimizer-impl fused      one kernel per step for every parameter (4-5x the for-loop optimizer's step)
  --log-every 10 (default)    one .item() (host sync) per 10 steps instead of every step (free on a CPU, where
                              nothing runs asynchronously; on a GPU each sync stalls the queue)
  --eval-mode inference       evaluation under inference_mode (outside the timed window: the evaluation entry)
  DataLoader                  num_workers 0, no pinning: the in-memory datasets here load a batch in ~0.1 ms,
                              and a worker process would take one of the 2 cores from the step (data_io/data_cpu)
  channels_last               not applied: no project flag (not measured)

Both train the same model on the same data with the same learning rate; the clock is the process's CPU time per
optimizer step between two steps of the first epoch (a global optimizer-step hook in both: no evaluation inside),
the fastest of its blocks (harness.StepClock). CPU time, because wall time on this shared 2-core machine measured the
other processes (a naive GPT step read 27 ms one minute and 92 ms the next); no worker processes load data on
either side, so the process's CPU time holds all of a step's work. The first steps of a compiled run hold the
compilation (outside the window): summary.json's compile_s, and the number of steps after which the faster step
has paid for it, are reported beside the ratio.
"""
from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

from manual_train.bench.harness import (Bench, Goal, Outcome, StepClock, interleave, median, ratio_row, single_config,
                                        train_single, value_row)

# name -> the run's flags, the speed-up flags, the timed window (first, last step; blocks of `block` steps)
CASES = {
    "gpt": dict(flags=("--model", "gpt", "--dataset", "reverse", "--optimizer", "adamw", "--lr", "3e-3",
                       "--batch-size", "32", "--epochs", "1"),
                speedups=("--compile", "model", "--optimizer-impl", "fused", "--eval-mode", "inference"),
                first=10, last=60, block=10, goal=0.7),
    "cnn": dict(flags=("--model", "cnn", "--dataset", "digits", "--batch-size", "32", "--epochs", "1"),
                speedups=("--optimizer-impl", "fused", "--eval-mode", "inference"),
                first=5, last=45, block=10, goal=None),
}


def _fast_run(case: str, compile_: bool = True) -> dict:
    """loops.single.train with every speed-up flag (without --compile when compile_ is False)."""
    c = CASES[case]
    speedups = list(c["speedups"])
    if not compile_ and "--compile" in speedups:
        del speedups[speedups.index("--compile"):speedups.index("--compile") + 2]
    clock = StepClock(c["first"], c["last"], c["block"])
    with tempfile.TemporaryDirectory() as tmp:
        summary = train_single(Path(tmp) / "run", *c["flags"], *speedups)
    return {"step_s": clock.per_step_s(), "compile_s": summary.get("compile_s") or 0.0}


def naive_epoch(model, loader, optimizer, loss_fn) -> list:
    """The articles' loop over one epoch: no accumulation, no precision, `.item()` every step (a host sync)."""
    losses = []
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # a host sync every step
    return losses


def _naive_step_s(case: str) -> float:
    """The 10-line loop, on the same data, initial weights and learning rate."""
    import torch

    from manual_train import data
    from manual_train.models import build_model, loss_fn

    c = CASES[case]
    cfg = single_config(*c["flags"])
    train_ds, _, info = data.build_datasets(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, info)
    opt_class = torch.optim.AdamW if cfg.optimizer == "adamw" else functools.partial(torch.optim.SGD, momentum=0.9)
    clock = StepClock(c["first"], c["last"], c["block"])
    # ---- the naive loop
    loader = torch.utils.data.DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True)
    optimizer = opt_class(model.parameters(), lr=cfg.lr, foreach=False, fused=False)
    naive_epoch(model, loader, optimizer, loss_fn)
    # ----
    return clock.per_step_s()


def _speedups_child(cases: tuple, repeats: int) -> dict:
    variants = {}
    for case in cases:
        variants[f"{case}/naive"] = functools.partial(_naive_step_s, case)
        variants[f"{case}/fast"] = functools.partial(_fast_run, case)
        if "--compile" in CASES[case]["speedups"]:
            variants[f"{case}/fast_eager"] = functools.partial(_fast_run, case, compile_=False)
    # No warm-up round: the timed window starts at step 10, after the first steps' compiling and first-call costs.
    # The first round's compile_s is what a fresh process pays; later runs in it reuse inductor's caches.
    return interleave({k: functools.partial(_timed, v) for k, v in variants.items()}, repeats, warmup=0)


def _timed(run) -> dict:
    t = time.perf_counter()
    result = run()
    result = result if isinstance(result, dict) else {"step_s": result}
    return {**result, "run_s": time.perf_counter() - t}


def speedups_vs_naive(bench: Bench) -> Outcome:
    cases = tuple(CASES)
    raw = bench.child(_speedups_child, cases=cases, repeats=bench.repeats(1, 5), timeout_s=1200)
    rows, notes = [], []
    for case in cases:
        c = CASES[case]
        naive = [r["step_s"] for r in raw[f"{case}/naive"]]
        fast = [r["step_s"] for r in raw[f"{case}/fast"]]
        metric = f"time per optimizer step, steps {c['first'] + 1}-{c['last']} ({case}, batch 32)"
        on = " ".join(c["speedups"])
        rows.append(ratio_row(bench.entry, "10-line naive loop", f"loops.single.train {on}", metric, naive, fast,
                              claim="(no number claimed)", goal=Goal("<=", c["goal"]) if c["goal"] else None))
        if f"{case}/fast_eager" in raw:
            eager = [r["step_s"] for r in raw[f"{case}/fast_eager"]]
            rows.append(ratio_row(bench.entry, "10-line naive loop", "the same without --compile", metric, naive,
                                  eager))
            compile_s = raw[f"{case}/fast"][0]["compile_s"]  # the first round's: a fresh process's
            saved = median(eager) - median(fast)
            rows.append(value_row(bench.entry, "eager", "--compile model", "compile_s (first run in a process)",
                                  [compile_s], unit="s"))
            pays = f"after about {compile_s / saved:,.0f} steps" if saved > 0 else "never here (no time saved per step)"
            notes.append(f"{case}: --compile model cost {compile_s:.1f} s in a fresh process; at {saved * 1e3:.2f} ms "
                         f"saved per step over the same run without it, it pays for itself {pays}: not within this "
                         f"entry's horizon (one epoch, 64 steps), so the ratio is of the steady step only.")
        notes.append(f"{case}: naive {median(naive) * 1e3:.2f} ms per step, all speed-ups "
                     f"{median(fast) * 1e3:.2f} ms")
    return Outcome(rows, raw, notes)
