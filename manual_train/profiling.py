"""--profile: torch.profiler over a window of optimizer steps (docs/everyday.md, "Profile a window of steps").

    python launch/single.py --profile-steps 10:15      # steps 11..15 recorded; step 10 warms the profiler up
    torchrun --nproc_per_node=2 launch/ddp.py --profile # every rank its own trace (5:10, the default window)

torch.profiler.profile with a schedule: skipped until the window, one warm-up step (the profiler starts its
collectors there, and that step's numbers are thrown away), then the window's steps recorded. The loop calls
`run.profile(step)` after every optimizer step, which is `profiler.step()`. When the window closes, it writes to
<out-dir>/profile/:
  trace-rank<R>.json ... a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing)
  ops-rank<R>.txt ...... the operators with the most self time (key_averages().table)
On CUDA it records CUDA activity too (kernels, copies, NCCL's all-reduce kernels on their own streams).
Profiling costs time (the first article's loop under it runs slower), which is why it covers a window only.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

TOP_OPS = 30


def start(window: tuple[int, int], start_step: int, device: torch.device, out_dir: Path, env, log):
    """A started profiler that records optimizer steps window[0]+1 .. window[1] (counted as the run counts them,
    also after a resume), or None when the run starts past the window's first step."""
    first, last = window
    if start_step > first:
        log.print(f"profile: this run starts at step {start_step}, past the window {first}:{last}; not profiling")
        return None
    warmup = min(1, first - start_step)  # step `first` warms up, when the run has one before the window
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    folder = Path(out_dir) / "profile"

    def write(prof) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"trace-rank{env.rank}.json"))
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        (folder / f"ops-rank{env.rank}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS))
        log.print(f"profile: steps {first + 1}..{last} recorded in {folder}")

    prof = profile(activities=activities, on_trace_ready=write,
                   schedule=schedule(wait=first - start_step - warmup, warmup=warmup, active=last - first, repeat=1))
    prof.start()
    return prof


def stop(prof) -> None:
    """Stop the profiler (a run that ended inside the window writes the steps it recorded)."""
    prof.stop()
