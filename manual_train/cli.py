"""The launch scripts' shared entry point: parse, validate, train; user errors as one line, exit 2."""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from manual_train.config import Config, UsageError, parse_config
from manual_train.runtime import TrainingDiverged


def run(train: Callable[[Config], dict], config_cls=Config, *, script: str, doc: Optional[str] = None,
        argv: Optional[Sequence[str]] = None, **defaults) -> int:
    """Exit status: 0 done, 1 training diverged (last good checkpoint kept), 2 bad input, 130 Ctrl-C."""
    try:
        cfg = parse_config(config_cls, argv, prog=f"{script}.py", description=doc, **defaults)
        train(cfg)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
