"""`LossSpikeWatch`: say when the training loss rises well above its best, although it stays finite.

`DivergenceGuard` stops a run at the first non-finite loss. A loss that jumps and does not come back
stays finite and passes it: TTT-E2E on a 1,200-step schedule at lr 1e-3 jumped from 2.06 to 2.89 near
step 200 and never recovered (docs/notes/history.md). This callback keeps an exponential moving average
of the loss each outer step returns. Once `warmup` outer steps have passed, it compares that average
with the lowest one so far. When the average exceeds the lowest by more than `rise` (a fraction of it),
the callback warns once, names the step and the keys to look at, and records the spike. It warns again
only after the average has come back within half that rise. The run goes on, since a spike that
recovers is not a failure. The spikes go into the run summary as `loss_spike_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from .divergence import DEFAULT_INNER_KEYS


class LossSpikeWatch(pl.Callback):
    """Warns when the smoothed training loss exceeds its lowest value by more than `rise` (fraction).

    smoothing: weight of each new loss in the moving average. warmup: outer steps before the lowest
    value is tracked (the early fall of the loss, and the lag of the average, are not spikes).
    inner_keys: the keys that size the recipe's inner steps (`RecipeConfig.inner_step_keys`; None:
    it has none), named in the warning. `spikes`: one dict per spike (step, loss_ema, best_ema)."""

    def __init__(
        self,
        rise: float = 0.2,
        smoothing: float = 0.05,
        warmup: int = 50,
        inner_keys: str | None = DEFAULT_INNER_KEYS,
    ):
        if not rise > 0 or not 0 < smoothing <= 1 or warmup < 0:
            raise ValueError(
                f"LossSpikeWatch needs rise > 0, 0 < smoothing <= 1 and warmup >= 0; got rise={rise}, "
                f"smoothing={smoothing}, warmup={warmup}"
            )
        self.rise, self.smoothing, self.warmup, self.inner_keys = rise, smoothing, warmup, inner_keys
        self.ema: float | None = None
        self.best = math.inf
        self.spiking = False
        self.spikes: list[dict[str, float]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        value = float(loss.detach())
        if not math.isfinite(value):
            return  # DivergenceGuard's case
        self.ema = value if self.ema is None else self.ema + self.smoothing * (value - self.ema)
        if trainer.global_step <= self.warmup:
            return
        self.best = min(self.best, self.ema)
        excess = (self.ema - self.best) / abs(self.best) if self.best else 0.0
        if not self.spiking and excess > self.rise:
            self.spiking = True
            self.spikes.append({"step": trainer.global_step, "loss_ema": self.ema, "best_ema": self.best})
            rank_zero_warn(self._message(trainer.global_step, excess))
        elif self.spiking and excess < self.rise / 2:
            self.spiking = False

    def _message(self, step: int, excess: float) -> str:
        keys = "optim.lr (and optim.warmup_steps, optim.grad_clip)"
        if self.inner_keys:
            keys += f", {self.inner_keys}"
        return (
            f"training loss spike at outer step {step}: its moving average ({self.ema:.4g}) is "
            f"{100 * excess:.0f}% above its lowest ({self.best:.4g}). The run goes on. If the loss does not "
            f"come back, the run has effectively diverged; look at {keys}"
        )

    def spike_steps(self) -> list[int]:
        """The outer steps at which spikes began, in order."""
        return [int(spike["step"]) for spike in self.spikes]

    def state_dict(self) -> dict:
        return {"ema": self.ema, "best": self.best, "spiking": self.spiking, "spikes": list(self.spikes)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.ema = state_dict.get("ema")
        self.best = float(state_dict.get("best", math.inf))
        self.spiking = bool(state_dict.get("spiking", False))
        self.spikes = list(state_dict.get("spikes", []))
