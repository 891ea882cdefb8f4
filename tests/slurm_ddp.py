"""launch/ddp.py with a Slurm notice timed by the test (tests/test_slurm.py): the seam for "a notice during set-up or
during a resume's load", moments a test cannot hit from outside.

    SLURM_NOTICE=setup,load,start   (in the job's environment: attempt i takes the i-th entry; "-" or none: no notice)

On an attempt with an entry, global rank 0 asks Slurm to signal the batch shell (`scancel --batch --signal=USR1`,
what `--signal=B:USR1@90` does at the time limit), which passes the notice down to the workers
(launch/slurm_train.sbatch), and every rank waits until it arrives: `start` before torch is even imported (no handler
yet: the processes die of it and save nothing, as a notice during their imports would), `setup` while the model is
built (after cli.run began catching notices), `load` while a resumed run loads its checkpoint.

    SLURM_STEP_SLEEP_S=1   on the first attempt, every optimizer step also sleeps this long (the numbers do not
                           change): a run that is still training when the time limit's notice comes

Everything else is launch/ddp.py.
"""
import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

ATTEMPT = int(os.environ.get("SLURM_RESTART_COUNT", 0)) + 1
PLAN = os.environ.get("SLURM_NOTICE", "").split(",")
WHEN = PLAN[ATTEMPT - 1] if ATTEMPT <= len(PLAN) and PLAN[ATTEMPT - 1] != "-" else ""
ASKS = WHEN and os.environ.get("RANK") == "0"  # one rank asks; every rank waits (start: they all import at once)


def ask_for_notice() -> None:
    subprocess.run(["scancel", "--batch", "--signal=USR1", os.environ["SLURM_JOB_ID"]], check=True)
    print(f"slurm_ddp: attempt {ATTEMPT}: notice asked for during {WHEN}", flush=True)


if WHEN == "start":
    if ASKS:
        ask_for_notice()
    time.sleep(120)  # the notice ends this process (no handler yet): nothing is saved
    sys.exit("slurm_ddp: the notice never came")

from manual_train import run as run_module  # noqa: E402
from manual_train.cli import run  # noqa: E402
from manual_train.loops import ddp  # noqa: E402


def wait_for_notice() -> None:
    if ASKS:
        ask_for_notice()
    deadline = time.monotonic() + 120
    while not run_module._notice[0]:
        if time.monotonic() > deadline:
            sys.exit("slurm_ddp: the notice never came")
        time.sleep(0.05)
    print(f"slurm_ddp: attempt {ATTEMPT}: SIGUSR1 arrived during {WHEN}", flush=True)


def during(fn):
    def wrapped(*args, **kwargs):
        wait_for_notice()
        return fn(*args, **kwargs)
    return wrapped


if os.environ.get("SLURM_STEP_SLEEP_S") and ATTEMPT == 1:
    real_loss_fn, sleep_s = ddp.loss_fn, float(os.environ["SLURM_STEP_SLEEP_S"])

    def slow_loss_fn(logits, y, **kw):
        if not kw:  # training's calls (evaluation's pass reduction="sum")
            time.sleep(sleep_s)
        return real_loss_fn(logits, y, **kw)

    ddp.loss_fn = slow_loss_fn
if WHEN == "setup":
    ddp.build_model_from = during(ddp.build_model_from)
if WHEN == "load":
    run_module.Run._load_model_optimizer = during(run_module.Run._load_model_optimizer)

if __name__ == "__main__":
    sys.exit(run(ddp.train, ddp.DDPConfig, script="ddp", doc=ddp.__doc__, **ddp.DEFAULTS))
