"""Benchmark outputs: machine info, the Markdown table, bench.json and the PNG chart.

Runs in the orchestrating process, which never imports torch (versions come from package metadata);
matplotlib is imported only when the chart is drawn, so `--help` and `--list` stay instant.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Optional


SCHEMA_VERSION = 1


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024  # MemTotal, in kB
    except (OSError, ValueError, IndexError):
        return None


def machine_info(cuda: dict) -> dict:
    """What the numbers depend on. `cuda` comes from gpu.cuda_info() run in a child process."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "mem_total_bytes": _mem_total_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torchvision": _version("torchvision"),
        "pytorch_lightning": _version("pytorch-lightning") or _version("lightning"),
        "cuda": cuda,
    }


# ---------------------------------------------------------------------- numbers as text
def fmt(value: Optional[float], unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def markdown_table(rows: list) -> str:
    """One line per Row: medians, min-max spread over the repeats, claim, goal, met."""
    head = ("| entry | baseline | variant | metric | median (variant/baseline, or value) | spread (min-max) | n "
            "| the source article claims | goal | met? |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lo, hi = r.spread
        unit = r.unit if r.kind == "value" else ""
        median = fmt(r.median, unit) + (" (higher is better)" if r.better == "higher" and r.kind == "ratio" else "")
        met = {True: "yes", False: "**no**", None: "-"}[r.met]
        cells = [r.entry, r.baseline, r.variant, r.metric, median, f"{fmt(lo)} - {fmt(hi)}", str(len(r.values)),
                 r.claim or "-", str(r.goal) if r.goal else "-", met]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def markdown_report(results: list, rows: list, machine: dict, command: str) -> str:
    cuda = machine.get("cuda") or {}
    device = cuda.get("name") if cuda.get("available") else "none"
    load = machine.get("load_avg_1_5_15")
    out = [f"Command: `{command}`  ",
           f"Date: {machine['date']}; CPU: {machine['cpu_model']} ({machine['cpus_usable']} usable of "
           f"{machine['cpu_count']} cores); load average at start (1/5/15 min): "
           + (", ".join(f"{v:.2f}" for v in load) if load else "n/a")
           + f"; torch {machine['torch']}; CUDA device: {device}", "", markdown_table(rows), ""]
    for result in results:
        if result["status"] != "ok":
            out.append(f"- **{result['name']}: {result['status']}** - {result['error']}")
        for note in result.get("notes", []):
            out.append(f"- {result['name']}: {note}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- bench.json
def _finite_or_none(obj):
    """JSON has no NaN or inf: write null for them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def write_json(path: Path, *, suite: str, quick: bool, command: str, machine: dict, results: list, rows: list,
               wall_s: float) -> None:
    doc = {"schema": SCHEMA_VERSION, "suite": suite, "quick": quick, "command": command, "wall_s": wall_s,
           "machine": machine, "entries": results, "rows": [r.as_dict() for r in rows]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_finite_or_none(doc), indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- the chart
GREEN, RED, GREY = "#3a9a5b", "#d1495b", "#9aa5b1"


def write_chart(path: Path, rows: list, title: str) -> bool:
    """Horizontal bars of every ratio row's median (log scale), min-max whiskers, goals as black ticks.

    Green: goal met, red: goal missed, grey: reported only. Returns False when there is nothing to draw.
    """
    ratio_rows = [r for r in rows if r.kind == "ratio" and math.isfinite(r.median) and r.median > 0]
    if not ratio_rows:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    from matplotlib.patches import Patch

    labels = [f"{r.entry}: {r.variant} / {r.baseline} [{r.metric.split(' (')[0].split(',')[0][:32]}]"
              + (f", goal {r.goal}" if r.goal else "") for r in ratio_rows]
    colors = [GREY if r.met is None else GREEN if r.met else RED for r in ratio_rows]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(ratio_rows) + 1.8))
    ys = list(range(len(ratio_rows)))[::-1]
    medians = [r.median for r in ratio_rows]
    lows = [max(r.median - r.spread[0], 0) for r in ratio_rows]
    highs = [max(r.spread[1] - r.median, 0) for r in ratio_rows]
    ax.barh(ys, medians, color=colors, xerr=[lows, highs], error_kw={"elinewidth": 1, "capsize": 2})
    for y, r in zip(ys, ratio_rows):
        ax.annotate(f"{r.median:.3g}", (r.median, y), xytext=(3, 5), textcoords="offset points", fontsize=7)
        if r.goal:
            ax.plot([r.goal.value, r.goal.value], [y - 0.42, y + 0.42], color="black", linewidth=2.5)
    ax.axvline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("variant / baseline, median of the paired repeats (log scale); whiskers: min-max; "
                  "black tick: the goal", fontsize=8)
    ax.legend(handles=[Patch(color=GREEN, label="goal met"), Patch(color=RED, label="goal missed"),
                       Patch(color=GREY, label="reported only")], fontsize=7, loc="best")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
