"""python -m manual_train.parity: do two trainings train the same model? The first optimizer step and parameter where
they part, or `equal within 1e-9 over N steps`.

    python -m manual_train.parity --a "launch/single.py --batch-size 24 --precision 64-true" \\
                                  --b "torchrun --nproc_per_node=3 launch/ddp.py --batch-size 8 --precision 64-true"
    python -m manual_train.parity --trace-a runs/mine/trace --trace-b runs/theirs/trace   # two traces, any code

--a/--b run two commands of this project (any launch script, python or torchrun, any flags) side by side, each with
--trace-dir added (and --out-dir, unless given), then compare what they recorded after every optimizer step: the
step's loss and every parameter and buffer, by name. Before training they are checked to be comparable: the same
--seed, --dataset (and its sizes), --model, --precision, number of steps (--epochs, --max-steps,
--limit-train-batches) and global batch (--batch-size x world size x --accumulate); a difference is refused,
naming the flag. --trace-a/--trace-b compare traces written by any code: manual_train.parity.record(model, step,
out_dir, loss=None) in your own loop, a Lightning callback or an Accelerate script (docs/parity.md, "The parity tool").

A trace folder: meta.json (what ran), steps.jsonl (one line per optimizer step: the loss and per tensor its float64
mean, root mean square, max |x| and 4 elements at fixed positions), weights/step-<N>.pt (the full float64 state
every step for models up to 1M numbers, every 50th above). A distance is the max abs difference where both have the
full state, else the largest checksum difference (never more than it). In 64-true the bound is 1e-9 for the
weights and 1e-5 relative for the loss (the loops sum it in float32 for logging). In 32-true a third run, A with its
initial weights one ulp up, measures the noise floor at every step, and B must stay within 10 floors (the largest
A-to-nudged distance so far), as the fp32 parity tests do; --no-floor skips it, and other precisions (16-mixed,
bf16-mixed) are reported without a verdict (docs/parity.md). Exit 0 equal (or no verdict), 1 parted, 2 bad input
or a run that failed. The runs train side by side (on a small machine, pass small models and few steps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

FORMAT = 1
TOL_64 = 1e-9  # weights, 64-true: tests/conftest.py's PARITY_TOL_64
# A step's loss is the sum of its micro-steps' weighted losses (float32 outside 64-true: ~1e-7 relative rounding,
# summed in another order on another path). The weights decide; the loss catches logging bugs.
LOSS_RTOL = 1e-5
FULL_EVERY_ELEMENTS = 1_000_000  # models up to this many numbers keep their full state every step
FULL_EVERY_LARGE = 50  # above: every 50th step (and the checksums every step)
SAMPLES = 4  # fixed-position elements per tensor in the checksums
# The flags two runs must share to be comparable, in the order a refusal names them
SAME_FLAGS = ("precision", "seed", "dataset", "synthetic_size", "synthetic_shape", "synthetic_classes", "block_size",
              "text_samples", "model")
STEP_FLAGS = ("epochs", "max_steps", "limit_train_batches")  # named when the number of optimizer steps differs


# ---------------------------------------------------------------------- writing a trace
def checksums(t) -> list:
    """float64 mean, root mean square and max |x| of a tensor, and SAMPLES elements at fixed positions: each
    differs between two tensors by at most their max abs difference."""
    import torch

    x = t.detach().to("cpu", torch.float64).flatten()
    n = x.numel()
    if n == 0:
        return [0.0] * (3 + SAMPLES)
    idx = [i * (n - 1) // (SAMPLES - 1) for i in range(SAMPLES)]
    return [x.mean().item(), x.square().mean().sqrt().item(), x.abs().max().item(), *x[idx].tolist()]


def _plain_name(name: str) -> str:
    """A state-dict key without the wrappers' prefixes (DDP's module., torch.compile's _orig_mod.)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


class TraceWriter:
    """One trace folder: meta.json at the first write, a steps.jsonl line per step, the full state every
    full_every steps (decided from the model's size at the first write unless given)."""

    def __init__(self, out_dir, meta: dict, full_every: Optional[int] = None):
        self.dir, self.meta, self.full_every = Path(out_dir), meta, full_every
        self.started = False

    def write(self, step: int, state: dict, loss: Optional[float] = None) -> None:
        import torch

        floating = {_plain_name(k): v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}
        if not self.started:
            (self.dir / "weights").mkdir(parents=True, exist_ok=True)
            if self.full_every is None:
                numbers = sum(v.numel() for v in floating.values())
                self.full_every = 1 if numbers <= FULL_EVERY_ELEMENTS else FULL_EVERY_LARGE
            dtypes = sorted({str(v.dtype).replace("torch.", "") for v in floating.values()})
            meta = {"format": FORMAT, "full_every": self.full_every, "dtypes": dtypes, **self.meta}
            (self.dir / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
            self.started = True
        line = {"step": int(step), "loss": None if loss is None else float(loss),
                "checksums": {k: checksums(v) for k, v in floating.items()}}
        with open(self.dir / "steps.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if step % self.full_every == 0:
            torch.save({k: v.detach().to("cpu", torch.float64).clone() for k, v in floating.items()},
                       self.dir / "weights" / f"step-{int(step):08d}.pt")


_writers: dict = {}
# Set by the tool for the third run that measures the fp32 noise floor: A's initial weights moved one ulp up
NUDGE_ENV = "MANUAL_TRAIN_PARITY_NUDGE_ULP"
FLOOR_FACTOR = 10  # tests/conftest.py's FP32_FLOOR_FACTOR


def nudge_one_ulp(model) -> None:
    """Move every parameter one ulp towards +inf, in place (a sharded parameter: this rank's shard, which is the same
    elementwise move of the full tensor), as tests/conftest.py's initial_weights_nudged does before training."""
    import torch

    module = model if isinstance(model, torch.nn.Module) else model.module
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.nextafter(local, torch.full_like(local, math.inf)))


def record(model, step: int, out_dir, loss=None) -> None:
    """Record one optimizer step of your own training into the trace folder out_dir (call it after every
    optimizer.step(), and once before the first with step 0 for the initial weights): every floating tensor of
    model.state_dict() by name (DDP's and torch.compile's prefixes dropped) and the loss (a float or a tensor; a
    tensor's .item() is a host sync). Under torchrun call it on rank 0 only, with the full (unsharded) state.
    `python -m manual_train.parity --trace-a DIR --trace-b DIR` compares two folders."""
    key = str(Path(out_dir).resolve())
    if key not in _writers:
        _writers[key] = TraceWriter(out_dir, {"source": "record"})
    if loss is not None and hasattr(loss, "item"):
        loss = loss.item()  # host sync
    _writers[key].write(step, model.state_dict(), loss)


class RunTrace:
    """--trace-dir inside manual_train.run.Run: the tracked model's full state after every optimizer step (its
    state_dict() is the checkpoints' one, which gathers the shards of ZeRO, FSDP2, TP and pipeline stages: every rank
    calls it, rank 0 writes) and the step's loss from the loop's list of detached micro-step losses (those added
    since the previous step, summed over the ranks and divided as the loop divides them when it logs)."""

    def __init__(self, run):
        self.run, self.writer, self.seen = run, None, 0
        # what the loops divide the all-summed losses by: every rank holds a share x its replicas (DDP, ZeRO,
        # hybrid, TP), except the pipeline, where the last stage alone holds the loss
        self.loss_ranks = 1 if run.script == "pipeline" else run.env.world_size

    def start(self, step: int) -> None:
        run, cfg = self.run, self.run.cfg
        self.step = step
        if os.environ.get(NUDGE_ENV) == "1" and step == 0:
            nudge_one_ulp(run.tracked["model"])  # the tool's noise-floor run (fp32): every rank alike
        if run.env.master_process:
            import dataclasses

            meta = {"source": run.script, "script": run.script, "world_size": run.env.world_size,
                    "replicas": run.replicas, "global_batch_size": run.global_batch_size,
                    "total_steps": run.total_steps, "start_step": step, "precision": cfg.precision,
                    "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}}
            self.writer = TraceWriter(cfg.trace_dir, meta)
        self._record(None)

    def stepped(self, losses) -> None:
        """`losses`: the loop's list of detached micro-step losses since its last log row (each already weighted by
        its share of the window); this step's are the ones added since the previous call."""
        self.step += 1
        loss = None
        if losses is not None:
            import torch

            new, self.seen = losses[self.seen:], len(losses)  # every micro-step adds one: never empty here
            delta = torch.stack(new).double().sum()
            if self.run.distributed:
                from manual_train.distributed import all_sum

                (delta,) = all_sum(delta, device=delta.device)
            loss = (delta / self.loss_ranks).item()
        self._record(loss)

    def window_logged(self) -> None:
        """log_train: the loop starts a new list after it."""
        self.seen = 0

    def _record(self, loss) -> None:
        state = self.run.tracked["model"].state_dict()  # every rank (a gather for sharded models); {} off rank 0
        if self.writer is not None:
            self.writer.write(self.step, state, loss)


# ---------------------------------------------------------------------- reading and comparing traces
class BadInput(Exception):
    """One line for the user; exit 2."""


def load_trace(path, flag: str) -> dict:
    folder = Path(path)
    if not (folder / "meta.json").is_file():
        raise BadInput(f"{flag}: {path} is not a trace folder (no meta.json)")
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{flag}: {folder / 'meta.json'} is unreadable ({e})") from None
    steps = {}
    if (folder / "steps.jsonl").is_file():
        for line in (folder / "steps.jsonl").read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut off by a killed run
            steps[entry["step"]] = entry  # a step recorded again (a resumed run) replaces the earlier record
    if not steps:
        raise BadInput(f"{flag}: {path} holds no recorded step")
    full = {int(p.stem.split("-")[1]): p for p in (folder / "weights").glob("step-*.pt")}
    return {"dir": folder, "meta": meta, "steps": steps, "full": full}


def refusal(a: dict, b: dict) -> Optional[str]:
    """Why two runs could not train the same model (the flag that differs), or None. Only traces of this project's
    runs carry their flags; record()'s traces are compared as they are."""
    ca, cb = a.get("config"), b.get("config")
    if not ca or not cb:
        return None
    for name in SAME_FLAGS:
        if ca.get(name) != cb.get(name):
            return f"--{name.replace('_', '-')} differs: {ca.get(name)} (A) vs {cb.get(name)} (B)"
    if a.get("global_batch_size") != b.get("global_batch_size"):
        return (f"the global batch (--batch-size x world size x --accumulate) differs: "
                f"{ca.get('batch_size')} x {a.get('replicas')} x {ca.get('accumulate')} = {a.get('global_batch_size')}"
                f" (A) vs {cb.get('batch_size')} x {b.get('replicas')} x {cb.get('accumulate')} = "
                f"{b.get('global_batch_size')} (B)")
    if a.get("total_steps") != b.get("total_steps"):
        flags = [f"--{n.replace('_', '-')} {ca.get(n)} (A) vs {cb.get(n)} (B)"
                 for n in STEP_FLAGS if ca.get(n) != cb.get(n)]
        return (f"the number of optimizer steps differs: {a.get('total_steps')} (A) vs {b.get('total_steps')} (B)"
                + (f" ({', '.join(flags)})" if flags else ""))
    return None


def _distance(ta: dict, tb: dict, step: int) -> dict:
    """{name: (distance, exact)} at one step: the max abs difference from the full states where both have them,
    else the largest checksum difference (a lower bound of it)."""
    if step in ta["full"] and step in tb["full"]:
        import torch

        wa, wb = (torch.load(t["full"][step], weights_only=True) for t in (ta, tb))
        return {k: ((wa[k] - wb[k]).abs().max().item() if wa[k].numel() else 0.0, True) for k in wa}
    ca, cb = ta["steps"][step]["checksums"], tb["steps"][step]["checksums"]
    # a NaN must win the max: Python's max keeps what came first when a comparison with NaN is False, so a NaN
    # after a finite difference would be dropped and a run gone non-finite there judged equal
    return {k: (max((abs(x - y) for x, y in zip(ca[k], cb[k])), key=lambda d: (math.isnan(d), d)), False)
            for k in ca}


def _loss_parts(la, lb) -> bool:
    if la is None or lb is None:
        return False
    if not (math.isfinite(la) and math.isfinite(lb)):
        return not (la == lb or (math.isnan(la) and math.isnan(lb)))
    return abs(la - lb) > LOSS_RTOL * max(abs(la), abs(lb), 1e-12)


def _fmt_loss(x) -> str:
    return "-" if x is None else f"{x:.10g}"


def _precision(trace: dict) -> str:
    """The run's --precision, or for a record() trace its dtypes (float64 counts as 64-true, float32 as 32-true)."""
    meta = trace["meta"]
    return meta.get("precision") or {"float64": "64-true", "float32": "32-true"}.get(
        "/".join(meta.get("dtypes", [])), "/".join(meta.get("dtypes", [])))


def compare(ta: dict, tb: dict, tol: float = TOL_64, floor: Optional[dict] = None) -> tuple[int, str]:
    """(exit status, report) for two loaded traces. 64-true: every weight within `tol` and the loss within
    LOSS_RTOL at every common step. 32-true with `floor` (a trace of A with its initial weights one ulp up): within
    FLOOR_FACTOR x the floor, the largest A-to-floor distance up to that step. Otherwise distances, no verdict."""
    common = sorted(set(ta["steps"]) & set(tb["steps"]))
    if not common:
        raise BadInput(f"the traces share no step: A has {_span(ta['steps'])}, B has {_span(tb['steps'])}")
    names_a, names_b = list(ta["steps"][common[0]]["checksums"]), list(tb["steps"][common[0]]["checksums"])
    if set(names_a) != set(names_b):
        only_a, only_b = sorted(set(names_a) - set(names_b)), sorted(set(names_b) - set(names_a))
        raise BadInput(f"the traces hold different tensors: only in A {only_a[:3]}, only in B {only_b[:3]}")
    precisions = {_precision(ta), _precision(tb)}
    mode = "64" if precisions == {"64-true"} else "floor" if floor is not None and precisions == {"32-true"} else None
    if mode == "floor" and not set(common) <= set(floor["steps"]):
        raise BadInput("--trace-floor: the floor trace lacks some of the compared steps")
    rows = []  # (step, distances, loss a, loss b, bound)
    parted, running_floor = None, 0.0
    for step in common:
        dist = _distance(ta, tb, step)
        la, lb = ta["steps"][step].get("loss"), tb["steps"][step].get("loss")
        bound = tol
        if mode == "floor":
            running_floor = max([running_floor, *(d for d, _ in _distance(ta, floor, step).values())])
            bound = FLOOR_FACTOR * running_floor
        rows.append((step, dist, la, lb, bound))
        over = any(d > bound or math.isnan(d) for d, _ in dist.values()) or mode == "64" and _loss_parts(la, lb)
        if parted is None and mode and over:
            parted = len(rows) - 1
    span = f"{len(common)} steps ({common[0]}-{common[-1]})" if len(common) > 1 else f"1 step ({common[0]})"
    worst = max(((d, s, k) for s, dist, *_ in rows for k, (d, _) in dist.items()), default=(0.0, 0, "-"))
    if mode is None:
        lines = [f"no verdict ({'/'.join(sorted(str(p) for p in precisions))}): rounding differs between code paths "
                 f"and grows with training, so no fixed bound holds; compare in --precision 64-true, or 32-true "
                 f"with a noise floor (docs/parity.md). Distances over {span}:"]
        lines += _table(rows, range(len(rows)))
        return 0, "\n".join(lines)
    within = f"{tol:g}" if mode == "64" else f"{FLOOR_FACTOR} x the fp32 noise floor"
    if parted is None:
        tail = (f"; losses within {LOSS_RTOL:g} relative" if mode == "64" else
                f" (floor {running_floor:.3g}: A with its initial weights one ulp up)")
        return 0, (f"equal within {within} over {span}: largest weight difference {worst[0]:.3g} "
                   f"({worst[2]}, step {worst[1]}){tail}")
    step, dist, la, lb, bound = rows[parted]
    first = next((k for k in names_a if dist[k][0] > bound or math.isnan(dist[k][0])), None)
    if first is None:
        head = (f"parted at optimizer step {step}: the loss, {_fmt_loss(la)} (A) vs {_fmt_loss(lb)} (B), while every "
                f"weight is within {within}")
    else:
        d, exact = dist[first]
        head = (f"parted at optimizer step {step}: first parameter {first}, distance {d:.3g}"
                f"{'' if exact else ' (at least: checksums)'} > {bound:.3g}; loss {_fmt_loss(la)} (A) vs "
                f"{_fmt_loss(lb)} (B)")
    earlier = rows[parted - 1][0] if parted else None
    head += f" (equal within {within} up to step {earlier})" if earlier is not None else ""
    later = [parted + k for k in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if parted + k < len(rows)]
    if later[-1] != len(rows) - 1:
        later.append(len(rows) - 1)
    lines = [head, f"how it grows (compared {span}):"] + _table(rows, later, first, bounds=mode == "floor")
    return 1, "\n".join(lines)


def _table(rows, picks, first=None, bounds=False) -> list:
    out = [f"  {'step':>6}  {'max distance':>12}  {'where':<24}" + (f"  {first[:24]:>24}" if first else "")
           + (f"  {'bound':>9}" if bounds else "") + f"  {'loss A':>14}  {'loss B':>14}"]
    for i in picks:
        step, dist, la, lb, bound = rows[i]
        name, (d, exact) = max(dist.items(), key=lambda kv: kv[1][0])
        line = f"  {step:>6}  {d:>12.3g}{' ' if exact else '≥'} {name[:24]:<24}"
        if first:
            line += f"  {dist[first][0]:>24.3g}"
        if bounds:
            line += f"  {bound:>9.3g}"
        out.append(line + f"  {_fmt_loss(la):>14}  {_fmt_loss(lb):>14}")
    if any(not e for _, dist, *_ in (rows[i] for i in picks) for _, e in dist.values()):
        out.append("  (≥: from checksums, a lower bound; the full state is kept every few steps)")
    return out


def _span(steps) -> str:
    return f"steps {min(steps)}-{max(steps)}"


# ---------------------------------------------------------------------- running two commands
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(text: str, flag: str, trace_dir: Path, out_dir: Path) -> list:
    """The command as argv, with the interpreter this tool runs under, torchrun on a free port (two jobs run side by
    side), --trace-dir and (unless given) --out-dir added."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise BadInput(f"{flag}: {text!r} cannot be split into arguments ({e})") from None
    if not argv:
        raise BadInput(f"{flag}: empty command (allowed: launch/<script>.py FLAGS, python ..., torchrun ...)")
    head = Path(argv[0]).name
    if head.startswith("python"):
        argv = [sys.executable, *argv[1:]]
    elif head == "torchrun":
        rest = argv[1:]
        if not any(a.startswith(("--master_port", "--master-port", "--standalone", "--rdzv")) for a in rest):
            rest = [f"--master_port={_free_port()}", *rest]
        argv = [sys.executable, "-m", "torch.distributed.run", *rest]
    elif argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    else:
        raise BadInput(f"{flag}: {argv[0]!r} is not python, torchrun or a .py script "
                       f"(allowed: launch/<script>.py FLAGS, python ..., torchrun ...)")
    script = next((a for a in argv[1:] if a.endswith(".py")), None)
    if script is None or not Path(script).is_file():
        raise BadInput(f"{flag}: no script {script or '<name>.py'} to run (allowed: one of launch/*.py)")
    if any(a.startswith("--trace-dir") for a in argv):
        raise BadInput(f"{flag}: --trace-dir is the tool's to set (leave it out)")
    argv += ["--trace-dir", str(trace_dir)]
    if not any(a.startswith("--out-dir") for a in argv):
        argv += ["--out-dir", str(out_dir)]
    return argv


def _steps_done(folder: Path) -> int:
    try:
        return (folder / "steps.jsonl").read_text().count("\n")
    except OSError:
        return 0


def _meta(folder: Path) -> Optional[dict]:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1].strip()


def run_pair(cmd_a: str, cmd_b: str, work: Path, quiet: bool = False, floor: bool = True) -> tuple:
    """Run both commands side by side (their output in work/a.log, work/b.log), refusing incomparable runs as soon
    as both have said what they run; progress lines meanwhile. `floor` and A in 32-true (said in its trace's
    meta.json): a third run, A with its initial weights one ulp up (work/floor/), measures the fp32 noise floor.
    Returns the traces (A, B, floor or None)."""
    work.mkdir(parents=True, exist_ok=True)
    jobs = {}
    runs = [("A", cmd_a, "--a", "a"), ("B", cmd_b, "--b", "b")]
    if floor and "64-true" not in cmd_a:
        runs.append(("floor", cmd_a, "--a", "floor"))
    for key, text, flag, name in runs:
        trace = work / name
        if trace.exists() and any(trace.iterdir()):
            raise BadInput(f"--work-dir: {trace} already holds a trace (allowed: a new --work-dir)")
        jobs[key] = dict(flag=flag, trace=trace, argv=build_command(text, flag, trace, work / f"{name}-run"),
                         log=work / f"{name}.log")
    def start(key: str, job: dict) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({NUDGE_ENV: "1"} if key == "floor" else {})}
        with open(job["log"], "w") as log:
            job["proc"] = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)  # its own group: torchrun's ranks end with it

    # The floor is 32-true's: its run starts once A has said its precision, and only for 32-true (started with A and
    # stopped later, a short run could finish first: a whole run for nothing, and on some machines, not on others).
    floor_job = jobs.pop("floor", None)
    for key, job in jobs.items():
        start(key, job)
    try:
        checked, shown, t_shown = False, None, 0.0
        while True:
            done = {k: j["proc"].poll() for k, j in jobs.items()}
            for key, rc in done.items():
                if rc not in (None, 0):
                    raise BadInput(f"{jobs[key]['flag']}: the run failed (exit {rc}): {_last_line(jobs[key]['log'])} "
                                   f"(log: {jobs[key]['log']})")
            metas = {k: _meta(j["trace"]) for k, j in jobs.items()}
            if not checked and metas["A"] and metas["B"]:
                why = refusal(metas["A"], metas["B"])
                if why:
                    raise BadInput(f"refused: the runs could not train the same model: {why}")
                checked = True
            if floor_job and metas["A"]:
                if metas["A"].get("precision") == "32-true":
                    start("floor", floor_job)
                    jobs["floor"] = floor_job
                floor_job = None
                continue
            if all(rc == 0 for rc in done.values()):
                for key, j in jobs.items():
                    if metas[key] is None:
                        raise BadInput(f"{j['flag']}: the run wrote no trace (a launch script of manual_train takes "
                                       f"--trace-dir; for your own loop use manual_train.parity.record and --trace-a)")
                break
            progress = {k: max(_steps_done(j["trace"]) - 1, 0) for k, j in jobs.items()}
            if not quiet and progress != shown and time.monotonic() - t_shown > 2:
                print("training: " + ", ".join(
                    f"{k} step {n}" + (f"/{metas[k]['total_steps']}" if (metas[k] or {}).get("total_steps") else "")
                    for k, n in progress.items()), flush=True)
                shown, t_shown = progress, time.monotonic()
            time.sleep(0.25)
    finally:
        for job in jobs.values():
            if job["proc"].poll() is None:
                os.killpg(job["proc"].pid, signal.SIGTERM)  # the group this tool started (torchrun and its ranks)
                job["proc"].wait()
    return (load_trace(jobs["A"]["trace"], "--a"), load_trace(jobs["B"]["trace"], "--b"),
            load_trace(jobs["floor"]["trace"], "--a") if "floor" in jobs else None)


# ---------------------------------------------------------------------- the command line
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"error: {message.replace('argument ', '', 1)}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m manual_train.parity", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", metavar="COMMAND", help="run A: a launch script and its flags, with python or torchrun, "
                                                  "quoted as one argument")
    p.add_argument("--b", metavar="COMMAND", help="run B, as --a")
    p.add_argument("--trace-a", metavar="DIR", help="compare this trace folder (instead of running --a)")
    p.add_argument("--trace-b", metavar="DIR", help="with --trace-a: the other trace folder")
    p.add_argument("--work-dir", metavar="DIR", help="where --a/--b keep their traces (a/, b/), outputs (a-run/, "
                                                     "b-run/) and logs (a.log, b.log) (default: "
                                                     "runs/parity-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--trace-floor", metavar="DIR", help="with --trace-a/--trace-b in 32-true: a trace of A with its "
                                                        "initial weights one ulp up (nudge_one_ulp), the noise floor")
    p.add_argument("--no-floor", action="store_true", help="--a/--b not in 64-true: skip the third run that measures "
                                                           "the noise floor (distances are shown without a verdict)")
    p.add_argument("--tol", type=float, default=TOL_64, help="the 64-true bound on the weights (default: %(default)g)")
    p.add_argument("--quiet", action="store_true", help="no progress lines while the runs train")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not (math.isfinite(args.tol) and args.tol >= 0):
            raise BadInput(f"--tol: {args.tol} is not a finite number >= 0")
        if args.trace_a or args.trace_b:
            if not (args.trace_a and args.trace_b) or args.a or args.b:
                raise BadInput("--trace-a: give --trace-a and --trace-b together, without --a/--b")
            ta, tb = load_trace(args.trace_a, "--trace-a"), load_trace(args.trace_b, "--trace-b")
            floor = load_trace(args.trace_floor, "--trace-floor") if args.trace_floor else None
            why = refusal(ta["meta"], tb["meta"])
            if why:
                raise BadInput(f"refused: the runs could not train the same model: {why}")
        else:
            if not (args.a and args.b):
                raise BadInput("--a: give --a and --b (two commands), or --trace-a and --trace-b (allowed: see --help)")
            work = Path(args.work_dir or Path("runs") / f"parity-{time.strftime('%Y%m%d-%H%M%S')}")
            ta, tb, floor = run_pair(args.a, args.b, work, quiet=args.quiet, floor=not args.no_floor)
        status, report = compare(ta, tb, args.tol, floor)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(report)
    return status


if __name__ == "__main__":
    sys.exit(main())
