"""The launch scripts' shared entry point: parse, validate, train; user errors as one line, exit 2."""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from manual_train.config import Config, UsageError, parse_config
from manual_train.runtime import TrainingDiverged


def run(train: Callable[[Config], dict], config_cls=Config, *, script: str, doc: Optional[str] = None,
        argv: Optional[Sequence[str]] = None, **defaults) -> int:
    """Exit status: 0 done, 1 training diverged (last good checkpoint kept), 2 bad input, 130 Ctrl-C.

    Under torchrun every rank meets the same bad flag or the same all-reduced NaN: local rank 0 prints
    the one line for its node, the other ranks exit with the same status silently.
    """
    report = int(os.environ.get("LOCAL_RANK", "0")) == 0
    try:
        cfg = parse_config(config_cls, argv, prog=f"{script}.py", description=doc, quiet=not report, **defaults)
        train(cfg)
    except UsageError as e:
        if report:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        if report:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if report:
            print("interrupted", file=sys.stderr)
        return 130
    return 0
