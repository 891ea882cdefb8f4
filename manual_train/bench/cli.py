"""`python -m manual_train.bench`: run the entries of a suite, then write the table, bench.json and chart.

    python -m manual_train.bench --suite cpu --quick              # make bench (time_to_target alone: minutes)
    python -m manual_train.bench --only data_io,loss_logging      # just these entries
    python -m manual_train.bench --suite gpu --quick --out $OUT   # on a CUDA machine (scripts/gpu_check.sh)
    python -m manual_train.bench --list                           # the entries of both suites

Outputs in --out (default bench-out/<suite>-<time>): bench.md (the table and notes), bench.json (every
raw number and the machine), bench.png (the ratios with the goals drawn in), logs/<entry>.log (what
each measurement process printed). Exit status: 0 all entries ran, 1 an entry failed (the others are
still reported), 2 bad input, 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from manual_train.config import UsageError, _OneLineParser, check_writable_dir

SUITES = ("cpu", "gpu")


def suite_entries(suite: str) -> dict:
    """name -> (function, description), in run order."""
    if suite == "cpu":
        from manual_train.bench.cpu import ENTRIES
    else:
        from manual_train.bench.gpu import ENTRIES
    return ENTRIES


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m manual_train.bench", description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=SUITES, default="cpu", help="which entries (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repeats and smaller runs (the CPU suite in under 10 minutes on 2 cores)")
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]",
                        help="run only these entries (repeatable; see --list)")
    parser.add_argument("--out", metavar="DIR", help="output folder (default: bench-out/<suite>-<time>)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help="measured repeats per entry after the warm-up (default: per entry, fewer with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in CPU-suite measurements (default: %(default)s; with 2 "
                             "threads on a busy 2-core machine tiny steps spend most of their time waiting for "
                             "the other thread)")
    parser.add_argument("--list", action="store_true", help="list the entries of both suites and exit")
    return parser


def _selected(args, entries: dict) -> list:
    if not args.only:
        return list(entries)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    for name in names:
        if name not in entries:
            raise UsageError("--only", f"no entry {name!r} in --suite {args.suite}", ", ".join(entries))
    return list(dict.fromkeys(names))


def _probe_cuda() -> dict:
    """torch.cuda facts, asked in a child process (this one never imports torch)."""
    from manual_train.bench import gpu
    from manual_train.bench.harness import fresh_process

    return fresh_process(gpu.cuda_info, {}, log_path=Path(os.devnull), timeout_s=300, threads=None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            for suite in SUITES:
                for name, (_, what) in suite_entries(suite).items():
                    print(f"{suite:4} {name:16} {what}")
            return 0
        entries = suite_entries(args.suite)
        names = _selected(args, entries)
        if args.threads < 1:
            raise UsageError("--threads", f"{args.threads} is out of range", ">= 1")
        if args.repeats is not None and args.repeats < 1:
            raise UsageError("--repeats", f"{args.repeats} is out of range", ">= 1")
        out = Path(args.out or Path("bench-out") / f"{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}")
        check_writable_dir(str(out), "--out")
        if (out / "bench.json").exists():
            raise UsageError("--out", f"{out} already holds bench.json (nothing is overwritten)", "a new --out folder")
        cuda = _probe_cuda()
        if args.suite == "gpu" and not cuda["available"]:
            raise UsageError("--suite", "gpu needs a CUDA device and torch.cuda.is_available() is False here", "cpu")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m manual_train.bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    try:
        return _run(args, entries, names, out, cuda, command)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _run(args, entries: dict, names: list, out: Path, cuda: dict, command: str) -> int:
    from tqdm import tqdm

    from manual_train.bench import report
    from manual_train.bench.harness import Bench

    (out / "logs").mkdir(parents=True, exist_ok=True)
    machine = report.machine_info(cuda)
    bench = Bench(suite=args.suite, quick=args.quick, threads=args.threads if args.suite == "cpu" else None,
                  log_dir=out / "logs", device_info=cuda, repeats_override=args.repeats)
    results, rows = [], []
    t_start = time.perf_counter()

    def write_tables() -> str:
        # after every entry, so a run stopped by a time limit (scripts/gpu_check.sh) keeps what it measured
        machine["load_avg_1_5_15_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        report.write_json(out / "bench.json", suite=args.suite, quick=args.quick, command=command, machine=machine,
                          results=results, rows=rows, wall_s=time.perf_counter() - t_start)
        text = report.markdown_report(results, rows, machine, command)
        (out / "bench.md").write_text(text)
        return text

    progress = tqdm(names, desc=f"bench {args.suite}", unit="entry", dynamic_ncols=True)
    for name in progress:
        progress.set_postfix_str(name)
        bench.entry = name
        t0 = time.perf_counter()
        result = {"name": name, "what": entries[name][1], "status": "ok", "error": None, "notes": [], "raw": {}}
        try:
            outcome = entries[name][0](bench)
            rows += outcome.rows
            result.update(notes=outcome.notes, raw=outcome.raw, rows=[r.as_dict() for r in outcome.rows])
            summary = "; ".join(f"{r.variant}: {report.fmt(r.median, r.unit if r.kind == 'value' else 'x')}"
                                for r in outcome.rows)
        except Exception as e:  # noqa: BLE001 - one failed entry must not lose the others' numbers
            result.update(status="error", error=f"{type(e).__name__}: {e}")
            summary = result["error"]
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
        progress.write(f"{name} ({result['wall_s']:.0f} s): {summary}")
        write_tables()
    progress.close()

    text = write_tables()
    title = (f"manual_train bench --suite {args.suite}{' --quick' if args.quick else ''}: {machine['cpu_model']}, "
             f"{cuda.get('name', 'no GPU') if cuda.get('available') else 'no GPU'}, {machine['date']}")
    charted = report.write_chart(out / "bench.png", rows, title)
    print(text)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}" + (f", {out / 'bench.png'}" if charted else "")
          + f" in {time.perf_counter() - t_start:.0f} s")
    failed = [r["name"] for r in results if r["status"] != "ok"]
    if failed:
        print(f"error: entries failed: {', '.join(failed)} (see {out / 'logs'})", file=sys.stderr)
        return 1
    return 0
