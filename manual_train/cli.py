"""The launch scripts' shared entry point: parse, validate, train; user errors as one line, exit 2."""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, Sequence

from manual_train.checkpoint import RunFinished
from manual_train.config import Config, UsageError, parse_config
from manual_train.errors import Preempted, StorageError
from manual_train.metrics import discard_unstarted_runs
from manual_train.run import catch_notices, check_launcher_forwards, restore_signal_handlers
from manual_train.runtime import TrainingDiverged

# How long a quiet rank that refused its flags waits for torchrun to stop it (see _wait_for_local_rank_0).
QUIET_RANK_WAIT_S = 60.0


def run(train: Callable[[Config], dict], config_cls=Config, *, script: str, doc: Optional[str] = None,
        argv: Optional[Sequence[str]] = None, **defaults) -> int:
    """Exit status: 0 done (or a resumed run that was already finished), 1 training diverged (last good
    checkpoint kept), 2 bad input, 74 a write the file system refused (disk full, I/O error, read-only; what is
    intact is said, nothing half-written is left under a final name), 75 stopped by a --save-on-signal signal
    after saving (requeue, or rerun with --resume auto), 130 Ctrl-C. A run that fails before its first log row
    leaves no folder.

    Under torchrun every rank meets the same bad flag or the same all-reduced NaN: local rank 0 prints
    the one line for its node, the other ranks exit with the same status silently. torchrun itself then
    prints its ChildFailedError report (which names the worker's exit status 2) and exits 1 whatever its
    workers returned; nothing a worker can do changes that short of faking success (exiting 0), and with
    --max-restarts N it restarts the workers N times first. docs/what-happens-when.md says so for users.
    """
    # One line per node under torchrun (which sets RANK for every worker); a process not started by a launcher
    # always reports, whatever LOCAL_RANK a shell left behind.
    report = "RANK" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        cfg = parse_config(config_cls, argv, prog=f"{script}.py", description=doc, quiet=not report, **defaults)
        check_launcher_forwards(cfg.preemption_signals)  # in a Slurm step: torchrun must pass the notices on
        try:
            catch_notices(cfg.preemption_signals)  # from here a notice is kept: one during the set-up stops the run
            train(cfg)
        except BaseException:
            discard_unstarted_runs()  # its folder would only block the next try ("already holds a run")
            restore_signal_handlers()  # a run that did not reach finish() gives them back here
            raise
    except RunFinished as e:
        if report:
            print(e)
        return 0
    except UsageError as e:
        if report:
            print(f"error: {e}", file=sys.stderr)
        else:
            _wait_for_local_rank_0(f"error: {e}")
        return 2
    except TrainingDiverged as e:
        if report:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:  # last.pt (last.dcp) saved at a step every rank agreed on
        if report:
            print(e, file=sys.stderr)
        return Preempted.EXIT_STATUS
    except StorageError as e:  # on rank 0 (a .pt: the others end when torchrun stops them), or on all (dcp shards)
        if report:
            print(f"error: {e}", file=sys.stderr)
        return StorageError.EXIT_STATUS
    except KeyboardInterrupt:
        if report:
            print("interrupted", file=sys.stderr)
        return 130
    return 0


def _wait_for_local_rank_0(line: str) -> None:
    """A quiet rank's refusal of its flags under torchrun. The first worker to exit has torchrun stop the others
    (SIGTERM): a quiet rank that exited first would stop local rank 0 before it said why (seen on a loaded 2-core
    machine, rank 0 still importing torch: the user got torchrun's report and no error line). So it waits to be
    stopped with the others: local rank 0 meets the same flags, prints the line and exits 2, and torchrun ends this
    rank at its next check (0.1 s). A refusal only this rank meets is said by it after QUIET_RANK_WAIT_S."""
    time.sleep(QUIET_RANK_WAIT_S)
    print(f"{line} (rank {os.environ.get('RANK')}; local rank 0 did not end the job)", file=sys.stderr)
