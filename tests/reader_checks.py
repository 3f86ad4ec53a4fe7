"""Checks shared by the tests of the TTT layers' readers (`model.token_losses(tokens, **options)`:
(B, N) int64 -> (B, N) per-token losses)."""

from __future__ import annotations

import torch


def meta_loss(model, x: torch.Tensor, **options) -> torch.Tensor:
    """The mean per-token loss of reading x (B, N), a scalar."""
    return model.token_losses(x, **options).mean()


def assert_rows_read_as_if_alone(model, x: torch.Tensor, losses_tol: dict, grads_tol: dict) -> None:
    """Rows of x (B, N) read side by side give each row's losses and outer gradient as read alone
    (tolerances: assert_close keyword arguments)."""
    together = model.token_losses(x)
    params = list(model.parameters())
    grads = torch.autograd.grad(together.mean(1).sum(), params)
    alone_grads = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        alone = model.token_losses(x[i : i + 1])
        torch.testing.assert_close(together[i : i + 1], alone, **losses_tol)
        for total, g in zip(alone_grads, torch.autograd.grad(alone.mean(), params)):
            total += g
    for a, b in zip(grads, alone_grads):
        torch.testing.assert_close(a, b, **grads_tol)
