"""Find the largest batch size that fits: double until it fails, then binary-search (docs/batch_size.md).

This is what Lightning's `Tuner.scale_batch_size(mode="binsearch")` does, without the Trainer:

    fits(b) for b = start, 2*start, 4*start, ...   until one fails (or the dataset size is reached)
    then binary search between the last size that fit and the first that failed.

`fits` must be monotone (if b fits, every smaller size fits). On CUDA a trial is one real training
step that either completes or raises torch.cuda.OutOfMemoryError; the memory is freed between
trials. On CPU nothing runs out of memory before the machine swaps, so a trial instead measures
its peak memory in a fresh subprocess and compares it with --memory-budget-bytes.
"""
from __future__ import annotations

import gc
from typing import Callable, Optional


def find_max_batch_size(fits: Callable[[int], bool], start: int = 1, limit: Optional[int] = None,
                        log: Callable[[str], None] = lambda msg: None) -> int:
    """The largest b in [start, limit] with fits(b), or 0 when even `start` does not fit."""
    assert start >= 1 and (limit is None or limit >= start)
    tried: dict[int, bool] = {}

    def trial(b: int) -> bool:
        if b not in tried:
            tried[b] = fits(b)
            log(f"batch size {b}: {'fits' if tried[b] else 'does not fit'}")
        return tried[b]

    if not trial(start):
        return 0
    good = start
    bad = None
    while bad is None:  # grow: double until a failure or the limit
        nxt = good * 2 if limit is None else min(good * 2, limit)
        if nxt == good:  # reached the limit and it fits
            return good
        if trial(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:  # shrink: binary search in (good, bad)
        mid = (good + bad) // 2
        if trial(mid):
            good = mid
        else:
            bad = mid
    return good


def cuda_step_fits(step: Callable[[int], None], device) -> Callable[[int], bool]:
    """Wrap one training step at batch size b: True if it ran, False on CUDA out-of-memory."""
    import torch

    def fits(b: int) -> bool:
        try:
            step(b)
            torch.cuda.synchronize(device)  # an OOM can surface asynchronously
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            gc.collect()  # drop the failed step's tensors before the next try
            torch.cuda.empty_cache()  # and give their blocks back, so the next trial starts clean

    return fits
