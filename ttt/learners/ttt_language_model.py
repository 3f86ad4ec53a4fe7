"""`TTTLanguageLearner`: meta-trains a `TTTTransformer` (or a `NeuralMemoryTransformer` or a
`TransformersTTTReader`, which read through the same interface) on text, end to end.

The outer loss is the mean next-token loss over every position of a sequence, each chunk scored
before the fast weights train on it; its gradient goes through all inner updates. Validation and
test read with and without test-time training ("_adapted" / "_unadapted"); after the test, loss by
token position and passkey accuracy by context length are written to the run directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ttt.config.schema import OuterOptimConfig
from ttt.layers import TransformersTTTReader, TTTTransformer
from ttt.layers.neural_memory import NeuralMemoryTransformer
from ttt.meta.learner import OuterLearner, refuse_inference_mode
from ttt.text.long_context import (
    MODES,
    LongContextEvalConfig,
    bin_positions,
    late_start,
    passkey_accuracy,
    window_ids,
    write_long_context_report,
)
from ttt.text.tokenizer import Tokenizer


class TTTLanguageLearner(OuterLearner):
    """Batches are {"tokens": (B, N) int64} (training batches may add "loss_weight" (B, N - 1) float32);
    each sequence adapts its own fast weights, and
    ttt.sequences_per_pass of them are read side by side (a pass of the outer step)."""

    progress_metric = "loss"

    def __init__(
        self,
        model: TTTTransformer | NeuralMemoryTransformer | TransformersTTTReader,
        optim: OuterOptimConfig,
        total_steps: int,
        *,
        evaluation: LongContextEvalConfig,
        tokenizer: Tokenizer,
        seed: int,
    ):
        super().__init__(optim, total_steps)
        self.model = model
        self.eval_cfg, self.tokenizer, self.seed = evaluation, tokenizer, seed
        self._position_sums: dict[str, torch.Tensor] = {}
        self._position_count = 0
        self._window_parts: dict[str, list[torch.Tensor]] = {}

    def initial_params(self) -> dict[str, torch.nn.Parameter]:
        """The fast weights' meta-learned initial values (live parameters of the model)."""
        return self.model.initial_fast_weights()

    def split_passes(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A batch {"tokens": (B, N)} (and "loss_weight" (B, N - 1) where the data weights positions) ->
        the passes, P = ttt.sequences_per_pass rows each (the last may have fewer)."""
        per_pass = self.model.ttt_cfg.sequences_per_pass or len(batch["tokens"])
        parts = {name: value.split(per_pass) for name, value in batch.items()}
        return [dict(zip(parts, rows)) for rows in zip(*parts.values())]

    def inner_lr_scale(self) -> float:
        """Inner learning-rate warm-up factor at the current outer step."""
        return self.model.ttt_cfg.lr_scale(self.global_step)

    def read(
        self, tokens: torch.Tensor, adapt: bool, keep_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluation reading of sequences (B, N), ttt.sequences_per_pass at a time: (logits (B, N, V),
        or None without keep_logits, losses (B, N - 1)), detached. adapt=True adapts only when
        ttt.enabled: the fast weights train on each chunk as they read it (the inner learning rates at
        `global_step`'s warm-up, a loaded learner's too). Runs in grad mode inside torch.no_grad too;
        refused under torch.inference_mode when it adapts."""
        if adapt and self.model.ttt_cfg.enabled:
            refuse_inference_mode(f"{type(self).__name__}.read(adapt=True)")
        logits, losses = [], []
        with torch.enable_grad():
            for rows in self.split_passes({"tokens": tokens}):
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

    def pass_loss(
        self, rows: dict[str, torch.Tensor], batch_size: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean next-token loss of each sequence of the pass (weighted by rows["loss_weight"] where
        given: data.passkey_answer_weight), read with test-time training, summed and divided by
        batch_size (the pass's share of the batch mean); logged as train/loss."""
        losses = self.model.token_losses(rows["tokens"], lr_scale=self.inner_lr_scale())
        if "loss_weight" in rows:
            weight = rows["loss_weight"].to(losses.dtype)
            loss = ((losses * weight).sum(1) / weight.sum(1)).sum() / batch_size
        else:
            loss = losses.mean(1).sum() / batch_size
        return loss, {"loss": loss.detach()}

    def step_metrics(self) -> dict[str, float]:
        """The inner learning rates' warm-up factor (train/inner_lr_scale)."""
        return {"inner_lr_scale": self.inner_lr_scale()}

    def position_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-position losses (B, N - 1) of a held-out batch, with ("adapted") and without TTT."""
        tokens = batch["tokens"]
        return {mode: self.read(tokens, adapt, keep_logits=False)[1] for mode, adapt in MODES.items()}

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean loss of a held-out batch, query_loss_adapted / _unadapted (every position is a query),
        and late_loss_adapted / _unadapted over its last eval.late_fraction of positions, the
        positions where long context can help (logged at every validation: val/late_loss_*)."""
        metrics = {}
        for mode, losses in self.position_losses(batch).items():
            late_from = late_start(losses.shape[1], self.eval_cfg.late_fraction)
            metrics[f"query_loss_{mode}"] = losses.mean()
            metrics[f"late_loss_{mode}"] = losses[:, late_from:].mean()
        return metrics

    def on_test_epoch_start(self) -> None:
        self._position_sums, self._position_count = {}, 0
        self._window_parts = {"window": [], **{mode: [] for mode in MODES}}

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses = self.position_losses(batch)
        self._window_parts["window"].append(window_ids(batch["tokens"]))
        for mode, value in losses.items():
            self._position_sums[mode] = self._position_sums.get(mode, 0) + value.sum(0)
            late_from = late_start(value.shape[1], self.eval_cfg.late_fraction)
            self._window_parts[mode].append(value[:, late_from:].mean(1))
        self._position_count += len(batch["tokens"])
        metrics = {f"query_loss_{mode}": value.mean() for mode, value in losses.items()}
        self.log_evaluation("test", metrics, self.batch_size(batch))

    def on_test_epoch_end(self) -> None:
        cfg = self.eval_cfg
        reduce = self.trainer.strategy.reduce  # sums over processes when the test set is shared out
        count = reduce(torch.tensor(float(self._position_count), device=self.device), reduce_op="sum")
        mean = {
            mode: (reduce(total, reduce_op="sum") / count).cpu().numpy()
            for mode, total in self._position_sums.items()
        }
        late_from = late_start(len(next(iter(mean.values()))), cfg.late_fraction)
        for mode, losses in mean.items():
            self.log(f"test/late_loss_{mode}", float(np.mean(losses[late_from:])))
        position_rows = {mode: bin_positions(losses, cfg.position_bins) for mode, losses in mean.items()}
        passkey_rows = passkey_accuracy(self.read, self.tokenizer, cfg, seed=self.seed, device=self.device)
        for row in passkey_rows:
            for mode in MODES:
                self.log(f"test/passkey_exact_{row['length']}_{mode}", row[f"exact_{mode}"])
                self.log(f"test/passkey_token_{row['length']}_{mode}", row[f"token_{mode}"])
        window_rows = self.late_loss_by_window()
        if self.trainer.is_global_zero:
            write_long_context_report(
                Path(self.trainer.default_root_dir), position_rows, passkey_rows, window_rows
            )

    def late_loss_by_window(self) -> list[dict[str, float | str]]:
        """Rows {window: its id in hex, late_loss_adapted, late_loss_unadapted}, one per test window of
        every process, in test-set order (the shares are contiguous and equal, so gathering them rank by
        rank restores it)."""
        gathered = {
            name: self.all_gather(torch.cat(parts)).reshape(-1).cpu()
            for name, parts in self._window_parts.items()
        }
        return [
            {
                "window": f"{int(window):016x}",
                **{f"late_loss_{mode}": float(gathered[mode][i]) for mode in MODES},
            }
            for i, window in enumerate(gathered["window"])
        ]
