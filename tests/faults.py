"""Test-only fault injection, kept out of the lessons (the loops carry no test-only code).

`inject(loop_module, at_step, rank, mode)` wraps the loop module's `loss_fn`: on global rank `rank`, the call
that would start optimizer step at_step + 1 (counted in this process's micro-steps, so the runs that use it keep
--accumulate 1) raises, kills the process with SIGKILL (no exception, no finally, no destroy_process_group), or
returns a NaN loss (a corrupt batch on this rank alone), or sends this process SIGTERM / SIGUSR1 and goes on (a
preemption notice arriving in the middle of a step, on this rank alone), or goes its own way ("alone": it waits for a
message from the next rank, which never sends one, while the others wait for it in their step's all-reduce: a hung
job, for tests/test_hang_deadline.py). Only on torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT 0, or a plain process): the group torchrun restarts after it (--max-restarts) runs
clean, which is what a transient fault, a lost node, looks like.

`tests/faulty_ddp.py` and `tests/faulty_zero.py` are launch/ddp.py and launch/zero.py with this applied from three
flags of their own.
"""
from __future__ import annotations

import math
import os
import signal

MODES = ("raise", "kill", "nan", "term", "usr1", "alone")


def inject(loop_module, at_step: int, rank: int, mode: str) -> None:
    assert mode in MODES, mode
    real_loss_fn = loop_module.loss_fn
    calls = 0

    def loss_fn(logits, y, **kw):
        nonlocal calls
        if kw:  # evaluation's (reduction="sum"): not an optimizer step's
            return real_loss_fn(logits, y, **kw)
        steps_done, calls = calls, calls + 1
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        if steps_done != at_step or int(os.environ.get("RANK", 0)) != rank or not first_attempt:
            return real_loss_fn(logits, y)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "nan":
            return real_loss_fn(logits, y) * math.nan
        if mode == "alone":
            import torch
            import torch.distributed as dist

            dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())  # never sent: hangs, with the others
        if mode in ("term", "usr1"):
            os.kill(os.getpid(), signal.SIGTERM if mode == "term" else signal.SIGUSR1)
            return real_loss_fn(logits, y)
        raise RuntimeError(f"injected failure on rank {rank} after {at_step} optimizer steps (--fail-at-step)")

    loop_module.loss_fn = loss_fn


def main(loop_module, script: str, default_mode: str, config_cls=None, defaults: dict = None) -> int:
    """A launch script with a fault injected: its own three flags, then the loop's as launch/<script>.py takes them
    (tests/faulty_single.py, faulty_ddp.py, faulty_zero.py are this, for their loop)."""
    import argparse

    from manual_train.cli import run
    from manual_train.config import Config

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--fail-at-step", type=int, required=True, help="optimizer steps done when it fails")
    parser.add_argument("--fail-rank", type=int, default=0, help="the global rank that fails")
    parser.add_argument("--fail-mode", choices=MODES, default=default_mode)
    parser.add_argument("--late-s", type=float, default=0.0,
                        help="local rank 0 starts the launch script this many seconds after the others (a worker "
                             "still importing on a loaded machine)")
    fault, rest = parser.parse_known_args()
    inject(loop_module, fault.fail_at_step, fault.fail_rank, fault.fail_mode)
    if fault.late_s and os.environ.get("LOCAL_RANK", "0") == "0":
        import time

        time.sleep(fault.late_s)
    return run(loop_module.train, config_cls or Config, script=script, doc=loop_module.__doc__, argv=rest,
               **(defaults or {}))
