"""Early stopping: stop when the monitored validation metric stops improving (docs/early_stopping.md).

A plain object the loop calls once per evaluation; it decides nothing on its own. Under DDP the
loop passes the all-reduced metric, so every rank computes the same decision from the same number
and they all leave the loop at the same epoch (no rank waits forever in a collective).

Defaults follow the source article (patience 10 evaluations); Lightning's EarlyStopping defaults
to patience 3, min_delta 0, mode "min".
"""
from __future__ import annotations

import math


class EarlyStopping:
    def __init__(self, monitor: str = "val_loss", patience: int = 10, min_delta: float = 0.0,
                 stop_at: float | None = None):
        assert monitor in ("val_loss", "val_acc"), monitor
        self.stop_at = stop_at  # --stop-at: a target; reaching it ends the run (Lightning's stopping_threshold)
        self.monitor = monitor
        self.mode = "min" if monitor == "val_loss" else "max"  # lower loss is better, higher accuracy is
        self.patience = patience  # 0 disables stopping (best.pt is still tracked)
        self.min_delta = min_delta
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = -1
        self.wait = 0  # evaluations since the last improvement
        self.should_stop = False
        self.reason = ""

    def update(self, value: float, epoch: int) -> bool:
        """Record one evaluation; returns True when it is a new best (write best.pt)."""
        if not math.isfinite(value):
            # A NaN never compares better, so patience would wait it out while training is broken.
            self.should_stop = True
            self.reason = f"{self.monitor} is {value} at epoch {epoch + 1}"
            return False
        if self.mode == "min":
            improved = value < self.best - self.min_delta
        else:
            improved = value > self.best + self.min_delta
        if self.stop_at is not None and (value <= self.stop_at if self.mode == "min" else value >= self.stop_at):
            self.should_stop = True
            self.reason = (f"target reached: {self.monitor} {value:.4f} at epoch {epoch + 1} "
                           f"(--stop-at {self.stop_at:g})")
        if improved:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return True
        self.wait += 1
        if self.patience and self.wait >= self.patience and not self.should_stop:
            self.should_stop = True
            self.reason = (f"{self.monitor} did not improve by more than {self.min_delta:g} "
                           f"for {self.wait} evaluations (best {self.best:.4f} at epoch {self.best_epoch + 1})")
        return False

    def state_dict(self) -> dict:
        return {"monitor": self.monitor, "best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "should_stop": self.should_stop, "reason": self.reason}

    def load_state_dict(self, state: dict) -> None:
        if state.get("monitor", self.monitor) != self.monitor:
            return  # a best val_loss is no best val_acc: start tracking afresh
        self.best, self.best_epoch, self.wait = float(state["best"]), int(state["best_epoch"]), int(state["wait"])
        self.should_stop, self.reason = bool(state["should_stop"]), str(state["reason"])
