"""`TTTLanguageLearner`: meta-trains a `TTTTransformer` (or a `NeuralMemoryTransformer` or a
`TransformersTTTReader`, which read through the same interface) on text, end to end.

The outer loss of a sequence is the mean of its next-token losses (ttt.loss_average: over its
targets, or over chunks of each chunk's mean), each chunk scored before the fast weights train on it;
its gradient goes through all inner updates. Batches may mask targets ("loss_mask": data.packing=stream
masks targets equal to BOS): the inner steps and the objective count only the kept ones. Validation and
test read with and without test-time training ("_adapted" / "_unadapted"); after the test, loss by
token position (binned, and every position unbinned) and passkey accuracy by context length are written
to the run directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ttt.config.schema import OuterOptimConfig
from ttt.layers import TransformersTTTReader, TTTTransformer
from ttt.layers.neural_memory import NeuralMemoryTransformer
from ttt.layers.objective import sequence_losses
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
    """Batches are {"tokens": (B, N) int64}, optionally with "loss_mask" (B, N - 1) bool (the targets that
    count) and, in training, "loss_weight" (B, N - 1) float32; each sequence adapts its own fast weights,
    and ttt.sequences_per_pass of them are read side by side (a pass of the outer step)."""

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
        self,
        tokens: torch.Tensor,
        adapt: bool,
        keep_logits: bool = True,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluation reading of sequences (B, N), ttt.sequences_per_pass at a time: (logits (B, N, V),
        or None without keep_logits, losses (B, N - 1)), detached. adapt=True adapts only when
        ttt.enabled: the fast weights train on each chunk as they read it (the inner learning rates at
        `global_step`'s warm-up, a loaded learner's too); loss_mask (B, N - 1): the targets the inner
        steps count (None: all). Adapting, it runs in grad mode inside torch.no_grad too, and is refused
        under torch.inference_mode; without adapting it runs under either."""
        adapt = adapt and self.model.ttt_cfg.enabled
        if adapt:
            refuse_inference_mode(f"{type(self).__name__}.read(adapt=True)")
        logits, losses = [], []
        batch = {"tokens": tokens} if loss_mask is None else {"tokens": tokens, "loss_mask": loss_mask}
        with torch.set_grad_enabled(adapt or torch.is_grad_enabled()):  # the inner steps need grad mode
            for rows in self.split_passes(batch):
                pass_logits, pass_losses = self.model.read(
                    rows["tokens"],
                    adapt=adapt,
                    lr_scale=self.inner_lr_scale(),
                    outer_grad=False,
                    keep_logits=keep_logits,
                    loss_mask=rows.get("loss_mask"),
                )
                logits.append(pass_logits)
                losses.append(pass_losses)
        return (torch.cat(logits) if keep_logits else None), torch.cat(losses)

    def pass_loss(
        self, rows: dict[str, torch.Tensor], batch_size: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of each sequence of the pass (`objective`; weighted by rows["loss_weight"] where given:
        data.passkey_answer_weight), read with test-time training, summed and divided by batch_size (the
        pass's share of the batch mean); logged as train/loss."""
        mask = rows.get("loss_mask")
        losses = self.model.token_losses(rows["tokens"], lr_scale=self.inner_lr_scale(), loss_mask=mask)
        if "loss_weight" in rows:
            weight = rows["loss_weight"].to(losses.dtype)
            loss = ((losses * weight).sum(1) / weight.sum(1)).sum() / batch_size
        else:
            loss = self.objective(losses, mask).sum() / batch_size
        return loss, {"loss": loss.detach()}

    def objective(self, losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Each sequence's loss from its next-token losses (B, T) and mask (B, T) or None, averaged as
        ttt.loss_average says (`ttt.layers.objective.sequence_losses`): (B,)."""
        ttt = self.model.ttt_cfg
        return sequence_losses(losses, mask, average=ttt.loss_average, chunk_len=ttt.chunk_len)

    def step_metrics(self) -> dict[str, float]:
        """The inner learning rates' warm-up factor (train/inner_lr_scale)."""
        return {"inner_lr_scale": self.inner_lr_scale()}

    def position_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-position losses (B, N - 1) of a held-out batch, with ("adapted") and without TTT (masked
        targets included: the mask decides what the inner steps and the objective count)."""
        tokens, mask = batch["tokens"], batch.get("loss_mask")
        return {mode: self.read(tokens, adapt, False, mask)[1] for mode, adapt in MODES.items()}

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of a held-out batch, with and without TTT: loss_adapted / _unadapted, the training objective
        (`objective`: masked, averaged as in training); query_loss_* the mean over every position;
        late_loss_* over its last eval.late_fraction of positions, where long context can help (logged at
        every validation: val/late_loss_*)."""
        metrics = {}
        for mode, losses in self.position_losses(batch).items():
            late_from = late_start(losses.shape[1], self.eval_cfg.late_fraction)
            metrics[f"loss_{mode}"] = self.objective(losses, batch.get("loss_mask")).mean()
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
        mask = batch.get("loss_mask")
        metrics.update({f"loss_{mode}": self.objective(value, mask).mean() for mode, value in losses.items()})
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
                Path(self.trainer.default_root_dir), position_rows, passkey_rows, window_rows, mean
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
