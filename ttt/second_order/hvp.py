"""Hessian-vector products and Hutchinson's estimate of the Hessian diagonal, for any loss of named
parameters.

Both differentiate twice in reverse mode (reverse-over-reverse): the gradient is taken with
create_graph=True and then differentiated again along a vector. Through `flashbob.flash_attention`
on its Triton path that second reverse pass runs the FlashBoB backward-over-backward kernels, so no
N x N attention tensor is ever stored.

A loss function takes a dict of parameter tensors and returns a scalar tensor; `module_loss_fn`
builds one from any `nn.Module` through `torch.func.functional_call`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ttt.inner.functional import functional_forward, select_parameters

LossFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def check_params(params: Mapping[str, torch.Tensor], *, name: str = "params") -> None:
    """Raise a clear error unless `params` is a non-empty dict of floating-point tensors on one device."""
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"{name} must be a non-empty dict of name -> tensor, got {type(params).__name__}")
    devices = set()
    for key, tensor in params.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name}[{key!r}] must be a floating-point tensor, got {tensor.dtype}")
        devices.add(tensor.device)
    if len(devices) > 1:
        raise ValueError(f"{name} must all be on one device, got {sorted(map(str, devices))}")


def check_vector(vector: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """Raise a clear error unless `vector` has exactly the keys of `params`, each tensor with the
    shape, dtype and device of its parameter."""
    if not isinstance(vector, Mapping):
        raise TypeError(
            f"vector must be a dict of name -> tensor keyed like params, got {type(vector).__name__}"
        )
    missing, extra = sorted(set(params) - set(vector)), sorted(set(vector) - set(params))
    if missing or extra:
        raise ValueError(f"vector must have the keys of params; missing {missing}, unexpected {extra}")
    for key, param in params.items():
        tensor = vector[key]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"vector[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != param.shape:
            raise ValueError(
                f"vector[{key!r}] must have shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        if tensor.dtype != param.dtype:
            raise TypeError(f"vector[{key!r}] must have dtype {param.dtype} like params, got {tensor.dtype}")
        if tensor.device != param.device:
            raise ValueError(f"vector[{key!r}] must be on {param.device} like params, got {tensor.device}")


def _differentiable_gradient(
    loss_fn: LossFn, params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Leaf copies of `params` that require grad, and the gradient of loss_fn at them with its graph."""
    leaves = {key: tensor.detach().requires_grad_(True) for key, tensor in params.items()}
    with torch.enable_grad():
        loss = loss_fn(leaves)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        if not loss.requires_grad:
            raise ValueError(
                "loss_fn's result does not depend on the params it is given: it must compute the loss "
                "from its argument (e.g. through module_loss_fn), not from the module's own parameters"
            )
        grads = torch.autograd.grad(
            loss.reshape(()), tuple(leaves.values()), create_graph=True, allow_unused=True
        )
    return leaves, grads


def _along(
    leaves: dict[str, torch.Tensor],
    grads: tuple[torch.Tensor, ...],
    vector: Mapping[str, torch.Tensor],
    *,
    retain: bool,
) -> dict[str, torch.Tensor]:
    """H v from the gradient graph: the reverse-mode derivative of <grad, v> with respect to the leaves.
    Parameters the loss (or its gradient) does not depend on get zeros."""
    used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    keys = list(leaves)
    products = [None] * len(keys)
    if used:
        products = torch.autograd.grad(
            [grads[i] for i in used],
            tuple(leaves.values()),
            grad_outputs=[vector[keys[i]] for i in used],
            retain_graph=retain,
            allow_unused=True,
        )
    return {
        key: torch.zeros_like(leaves[key]) if product is None else product.detach()
        for key, product in zip(keys, products)
    }


def hvp(
    loss_fn: LossFn, params: Mapping[str, torch.Tensor], vector: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The Hessian of loss_fn at `params` times `vector`, by reverse-over-reverse differentiation.

    loss_fn: dict of tensors keyed like params -> scalar tensor.
    params: name -> tensor of any shape (floating point, one device); not modified, and their own
        .grad is not touched (the derivative is taken at detached copies).
    vector: name -> tensor with the keys, shapes, dtypes and device of params.
    Returns name -> (H v)[name], shaped like params[name], detached.
    """
    check_params(params)
    check_vector(vector, params)
    leaves, grads = _differentiable_gradient(loss_fn, params)
    return _along(leaves, grads, {key: t.detach() for key, t in vector.items()}, retain=False)


def rademacher_like(tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor shaped, typed and placed like `tensor` with entries +1 or -1, each with probability 1/2."""
    bits = torch.randint(0, 2, tensor.shape, generator=generator, device=tensor.device)
    return (2 * bits - 1).to(tensor.dtype)


def hutchinson_diagonal(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    n_samples: int = 1,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Hutchinson's unbiased estimate of the Hessian diagonal of loss_fn at `params`:
    mean over n_samples Rademacher probes z of z * (H z).

    One forward and one differentiable backward build the gradient's graph; each probe then costs
    one backward-over-backward pass through that graph (kept until the last probe).
    loss_fn, params: as in `hvp`. generator: draws the probes (on params' device); None: the global RNG.
    Returns name -> estimate of diag(H)[name], shaped and typed like params[name], detached.
    """
    check_params(params)
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    device = next(iter(params.values())).device
    if generator is not None and generator.device != device:
        raise ValueError(f"generator must be on {device} like params, got a generator on {generator.device}")
    leaves, grads = _differentiable_gradient(loss_fn, params)
    # accumulated in at least float32, so that many probes of a bf16 model do not round away
    estimate = {
        key: torch.zeros_like(tensor, dtype=torch.promote_types(tensor.dtype, torch.float32))
        for key, tensor in leaves.items()
    }
    for sample in range(n_samples):
        probe = {key: rademacher_like(tensor, generator) for key, tensor in leaves.items()}
        product = _along(leaves, grads, probe, retain=sample < n_samples - 1)
        for key in estimate:
            estimate[key].add_(probe[key] * product[key], alpha=1.0 / n_samples)
    return {key: total.to(leaves[key].dtype) for key, total in estimate.items()}


def module_loss_fn(
    module: nn.Module,
    names: Sequence[str] | Mapping[str, torch.Tensor],
    batch,
    loss: Callable[[object, object], torch.Tensor],
) -> tuple[LossFn, dict[str, torch.Tensor]]:
    """A loss function of `module`'s parameters for `hvp` / `hutchinson_diagonal`, and those parameters.

    names: glob patterns of the parameters to differentiate (`ttt.inner.select_parameters`), or a dict
        of already selected name -> parameter.
    batch: the module's input (passed as module(batch)).
    loss: (module output, batch) -> scalar tensor, e.g. the next-token cross-entropy.
    Returns (loss_fn, params): loss_fn(p) = loss(module(batch) with p in place of those parameters,
    batch); params is name -> the module's current parameter. Parameters not selected stay fixed.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(names, str):
        raise TypeError(
            f"names must be a list of glob patterns or a dict of parameters, got the string {names!r}"
        )
    params = dict(names) if isinstance(names, Mapping) else select_parameters(module, list(names))
    known = dict(module.named_parameters())
    for key in params:
        if key not in known:
            raise ValueError(
                f"names: {key!r} is not a parameter of the module; parameters are: {list(known)}"
            )

    def loss_fn(substituted: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss(functional_forward(module, substituted, batch), batch)

    return loss_fn, params
