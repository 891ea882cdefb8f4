"""A one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this machine, from a config written into a
temporary folder. It installs nothing (`.ci/run` installs Debian's slurm-wlm and munge); what is missing is one line.

    python tests/local_slurm.py start DIR    # prints `export SLURM_CONF=DIR/slurm.conf`; sbatch, squeue... then work
    python tests/local_slurm.py stop DIR     # stops the three daemons (by the pids they wrote into DIR)

The daemons run as root (Slurm's SlurmUser and SlurmdUser; munged with --force), so starting one needs root, as the
tests' CI machine has. Everything they write (state, spool, logs, pid files, munge's key and socket) stays in DIR:
nothing under /etc or /run is touched, so a machine's own Slurm, if any, is left alone; the ports are ones the OS
found free. Verified with Debian's slurm-wlm 22.05.8 and munge 0.5.15 (docs/checkpointing.md, "Tested under Slurm").
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm"}  # program -> Debian package
CLIENTS = {**{name: "slurm-client" for name in ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")}, "munge": "munge"}
CRED_EXPIRE_S = 30
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def missing() -> Optional[str]:
    """One line saying what this machine lacks to run a local Slurm, or None when nothing is missing."""
    absent = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if absent:
        packages = sorted({({**DAEMONS, **CLIENTS})[n] for n in absent})
        return (f"no local Slurm: {', '.join(absent)} not installed (apt-get install {' '.join(packages)}; "
                ".ci/run does)")
    if os.geteuid() != 0:
        return "no local Slurm: its daemons run as root here (SlurmUser=root); this user is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """One node (this machine, named by its short hostname) in partition `debug`. `env` is what a client command
    (sbatch, scontrol, squeue, scancel) needs: SLURM_CONF pointing at this cluster's config."""

    def __init__(self, root: Path, cpus: Optional[int] = None):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.socket = self.root / "munge" / "munge.socket.2"

    # ------------------------------------------------------------------ config
    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        r = self.root
        lines = [
            "ClusterName=localtest", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: how long a job credential lives, and so how long a requeued job waits before it may
            # start again (its begin time; Slurm's default 120 s). Shorter here to keep the tests short; long enough
            # for a step to start on a loaded machine.
            f"AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}",
            "SlurmUser=root", "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            # as on a site that requeues only the jobs submitted with --requeue (Slurm's default is 1)
            "JobRequeue=0", "SchedulerType=sched/backfill",
            # a job's steps get KillWait seconds between SIGTERM and SIGKILL (Slurm's default: 30)
            "KillWait=30", "MinJobAge=600",
            # the scheduler looks at pending jobs every few seconds, not once a minute
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # 22.05 has no "disabled" cgroup plugin and slurmd will not start without one: v1, constraining nothing
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainCores=no\n"
                                       "ConstrainRAMSpace=no\n")

    # ------------------------------------------------------------------ start, stop
    def start(self, timeout_s: float = 60) -> None:
        """Write the config, start the three daemons and wait for the node to be idle (or raise, with the logs'
        tails). On any failure the daemons already started are stopped."""
        self.write_config()
        r = self.root
        try:
            subprocess.run([_which("munged"), "--force", f"--socket={self.socket}",
                            f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                            f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munged.seed"],
                           check=True, capture_output=True, text=True)
            subprocess.run([_which("slurmctld"), "-i", "-f", str(self.conf)], check=True, env=self.env,
                           capture_output=True, text=True)
            subprocess.run([_which("slurmd"), "-f", str(self.conf), "-N", self.host], check=True, env=self.env,
                           capture_output=True, text=True)
            deadline = time.monotonic() + timeout_s
            while self.node_state() != "idle":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"local Slurm: the node is not idle after {timeout_s:.0f} s "
                                       f"(state {self.node_state()!r})\n{self.logs()}")
                time.sleep(0.5)
        except BaseException as e:
            self.stop()
            if isinstance(e, subprocess.CalledProcessError):
                raise RuntimeError(f"local Slurm: {e.cmd[0]} failed: {e.stderr.strip()}\n{self.logs()}") from None
            raise

    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL after 10 s), by the pids in their files. Job
        processes still running are ended first (scancel), so none outlives the cluster."""
        if self.conf.exists() and (self.root / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user", "root"], env=self.env,
                           capture_output=True, timeout=30)
            subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            _stop_pid(self.root / pid_file)

    # ------------------------------------------------------------------ clients
    def node_state(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else f"(sinfo: {proc.stderr.strip()})"

    def logs(self, lines: int = 15) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)


def _stop_pid(pid_file: Path, wait_s: float = 10) -> None:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python tests/local_slurm.py start|stop DIR", file=sys.stderr)
        return 2
    reason = missing()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    cluster = LocalSlurm(Path(argv[1]).resolve())
    if argv[0] == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
