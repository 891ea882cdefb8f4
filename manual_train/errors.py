"""The one user-error type (every check in manual_train raises it, manual_train.cli.run prints it), and the one
storage-fault type (a write the file system refused).

Its own module so that any module can raise it without importing the config (which imports the
checks of other modules): no import cycles.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional


class UsageError(Exception):
    """A user error: printed as one `error: --flag: ...` line, exit status 2, no traceback."""

    def __init__(self, flag: str, what: str, allowed: Optional[str] = None):
        self.flag, self.what, self.allowed = flag, what, allowed
        text = f"{flag}: {what}" if flag else what
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)


# What a user reads for the errno of a write that failed: the file system, not the input, is at fault.
_STORAGE_FAULTS = {
    errno.ENOSPC: ("disk full", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EIO: ("I/O error", "check the disk (dmesg)"),
    errno.EROFS: ("read-only file system", "remount it writable or pass another --out-dir"),
    errno.ENOENT: ("the folder is gone", "recreate it"),
    errno.EACCES: ("permission denied", "make the folder writable"),
    errno.EPERM: ("operation not permitted", "make the folder writable"),
}


class StorageError(Exception):
    """A write the file system refused (disk full, I/O error, read-only, the folder removed): printed as one line
    naming the file, what the OS said and what is intact; exit status 74 (sysexits' EX_IOERR): the input was fine,
    and the run can go on with --resume auto once the disk can take it."""

    EXIT_STATUS = 74

    def __init__(self, path, error: OSError, intact: str):
        what, fix = _STORAGE_FAULTS.get(error.errno, (error.strerror or str(error), "fix the storage"))
        self.path, self.errno = path, error.errno
        # --resume auto reads the folder's last.pt; without one there is nothing to go on from
        rerun = ("rerun with --resume auto" if (Path(path).parent / "last.pt").exists() or
                 (Path(path).parent / "last.dcp").exists() else "rerun (no checkpoint yet: into a new --out-dir)")
        super().__init__(f"{what} writing {path}; {intact}; {fix} and {rerun}")


def os_error_in(e: BaseException, where=None) -> Optional[OSError]:
    """The OSError with an errno behind `e`, itself or in its chain (torch.save reports a failed write as a
    RuntimeError from its zip writer, raised while handling the file object's OSError; DCP gathers every rank's
    exceptions into a CheckpointException), else None.

    DCP gathers those exceptions by pickling them, and a pickled exception loses its chain: a zip writer's
    RuntimeError then arrives alone (CI, 2026-12-05: "[enforce fail at inline_container.cc:672] . unexpected pos 704
    vs 598" on a full tmpfs, exit 1 with a traceback). For that one error the folder `where` decides: no space left
    on it is ENOSPC, else EIO (a write came up short without saying why)."""
    seen, zip_writer = set(), None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        if isinstance(e, RuntimeError) and any(mark in str(e) for mark in _ZIP_WRITER_FAULTS):
            zip_writer = zip_writer or e
        for failure, _ in getattr(e, "failures", {}).values():  # DCP's CheckpointException: every rank's failure
            found = os_error_in(failure, where)
            if found is not None:
                return found
        e = e.__cause__ or e.__context__
    if zip_writer is None or where is None:
        return None
    disk = os.statvfs(where)
    code = errno.ENOSPC if disk.f_bavail * disk.f_frsize < _FULL_BELOW else errno.EIO
    return OSError(code, f"{os.strerror(code)} (torch's zip writer: {str(zip_writer).splitlines()[0][:120]})")


# torch's zip writer (torch.save) checks its own position and byte counts; these are its words for a short write
_ZIP_WRITER_FAULTS = ("inline_container.cc", "PytorchStreamWriter failed writing")
_FULL_BELOW = 1 << 20  # bytes free under which a short write is read as a full disk (a checkpoint is larger)


class Preempted(Exception):
    """A run stopped by a preemption signal (--save-on-signal) after saving at an optimizer-step boundary: one line
    naming the signal, the step and the checkpoint; exit status 75 (sysexits' EX_TEMPFAIL: try again), on which a
    Slurm batch script requeues the job (docs/checkpointing.md)."""

    EXIT_STATUS = 75
