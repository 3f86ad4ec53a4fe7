"""`TTTLanguageLearner`: meta-trains a `TTTTransformer` on text, end to end.

The outer loss is the mean next-token loss over every position of a sequence, each chunk scored
before the fast weights train on it; its gradient goes through all inner updates. Validation and
test read with and without test-time training ("_adapted" / "_unadapted"); after the test, loss by
token position and passkey accuracy by context length are written to the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from ttt.config.schema import OuterOptimConfig
from ttt.meta.distributed import task_backward
from ttt.meta.outer import outer_optimizers, outer_update
from ttt.text.long_context import (
    MODES,
    LongContextEvalConfig,
    bin_positions,
    passkey_accuracy,
    write_long_context_report,
)
from ttt.text.tokenizer import Tokenizer
from ttt.ttt_layers import TTTTransformer


class TTTLanguageLearner(pl.LightningModule):
    """Batches are {"tokens": (B, N) int64}; each sequence adapts its own fast weights, and
    ttt.sequences_per_pass of them are read side by side."""

    def __init__(
        self,
        model: TTTTransformer,
        optim: OuterOptimConfig,
        total_steps: int,
        *,
        evaluation: LongContextEvalConfig,
        tokenizer: Tokenizer,
        seed: int,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.model, self.optim_cfg, self.total_steps = model, optim, total_steps
        self.eval_cfg, self.tokenizer, self.seed = evaluation, tokenizer, seed
        self._position_sums: dict[str, torch.Tensor] = {}
        self._position_count = 0

    def initial_params(self) -> dict[str, torch.nn.Parameter]:
        """The fast weights' meta-learned initial values (live parameters of the model)."""
        return self.model.initial_fast_weights()

    def split_tasks(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A batch {"tokens": (B, N)} -> the passes {"tokens": (P, N)}, P = ttt.sequences_per_pass rows
        each (the last may have fewer)."""
        tokens = batch["tokens"]
        per_pass = self.model.ttt_cfg.sequences_per_pass or len(tokens)
        return [{"tokens": rows} for rows in tokens.split(per_pass)]

    def inner_lr_scale(self) -> float:
        """Inner learning-rate warm-up factor at the current outer step."""
        return self.model.ttt_cfg.lr_scale(self.global_step)

    def read(
        self, tokens: torch.Tensor, adapt: bool, keep_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluation reading of sequences (B, N), ttt.sequences_per_pass at a time: (logits (B, N, V),
        or None without keep_logits, losses (B, N - 1)), detached. adapt=True adapts only when
        ttt.enabled."""
        logits, losses = [], []
        with torch.enable_grad():
            for rows in self.split_tasks({"tokens": tokens}):
                pass_logits, pass_losses = self.model.read(
                    rows["tokens"],
                    adapt=adapt and self.model.ttt_cfg.enabled,
                    lr_scale=self.inner_lr_scale(),
                    outer_grad=False,
                    keep_logits=keep_logits,
                )
                logits.append(pass_logits)
                losses.append(pass_losses)
        return (torch.cat(logits) if keep_logits else None), torch.cat(losses)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        passes, n_sequences = self.split_tasks(batch), len(batch["tokens"])
        optimizer.zero_grad()
        total, pass_losses = torch.zeros((), device=self.device), []
        backward = task_backward(self, optimizer, len(passes))  # DDP: one all-reduce per outer step
        for rows in passes:  # one pass's graph alive at a time
            losses = self.model.token_losses(rows["tokens"], lr_scale=self.inner_lr_scale())
            loss = losses.mean(1).sum() / n_sequences  # this pass's share of the batch mean
            backward(loss)
            total += loss.detach()
            pass_losses.append(loss.detach())
        lr = outer_update(self, optimizer, scheduler, self.optim_cfg)
        metrics = {"train/loss": total, "train/lr": lr, "train/inner_lr_scale": self.inner_lr_scale()}
        self.log_dict(metrics, batch_size=n_sequences, sync_dist=True)
        self.log("loss", total, prog_bar=True, logger=False, batch_size=n_sequences)
        # Per-pass losses: the divergence guard (ttt.tracking) names the pass that went non-finite.
        return {"loss": total, "pass_losses": torch.stack(pass_losses)}

    def position_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-position losses (B, N - 1) of a held-out batch, with ("adapted") and without TTT."""
        tokens = batch["tokens"]
        return {mode: self.read(tokens, adapt, keep_logits=False)[1] for mode, adapt in MODES.items()}

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean loss of a held-out batch: query_loss_adapted / _unadapted (every position is a query)."""
        return {f"query_loss_{mode}": losses.mean() for mode, losses in self.position_losses(batch).items()}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.evaluate(batch)
        self.log_dict(
            {f"val/{k}": v for k, v in metrics.items()}, batch_size=len(batch["tokens"]), sync_dist=True
        )

    def on_test_epoch_start(self) -> None:
        self._position_sums, self._position_count = {}, 0

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses = self.position_losses(batch)
        for mode, value in losses.items():
            self._position_sums[mode] = self._position_sums.get(mode, 0) + value.sum(0)
        self._position_count += len(batch["tokens"])
        self.log_dict(
            {f"test/query_loss_{mode}": value.mean() for mode, value in losses.items()},
            batch_size=len(batch["tokens"]),
            sync_dist=True,
        )

    def on_test_epoch_end(self) -> None:
        cfg = self.eval_cfg
        reduce = self.trainer.strategy.reduce  # sums over processes when the test set is shared out
        count = reduce(torch.tensor(float(self._position_count), device=self.device), reduce_op="sum")
        mean = {
            mode: (reduce(total, reduce_op="sum") / count).cpu().numpy()
            for mode, total in self._position_sums.items()
        }
        late_from = int(len(next(iter(mean.values()))) * (1 - cfg.late_fraction))
        for mode, losses in mean.items():
            self.log(f"test/late_loss_{mode}", float(np.mean(losses[late_from:])))
        position_rows = {mode: bin_positions(losses, cfg.position_bins) for mode, losses in mean.items()}
        passkey_rows = passkey_accuracy(self.read, self.tokenizer, cfg, seed=self.seed, device=self.device)
        for row in passkey_rows:
            for mode in MODES:
                self.log(f"test/passkey_exact_{row['length']}_{mode}", row[f"exact_{mode}"])
        if self.trainer.is_global_zero:
            write_long_context_report(Path(self.trainer.default_root_dir), position_rows, passkey_rows)

    def configure_optimizers(self) -> dict[str, Any]:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return outer_optimizers(trainable, self.optim_cfg, self.total_steps)
