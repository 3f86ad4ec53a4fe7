"""Choosing parameters by name and calling a module with substituted parameters."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call


def select_parameters(module: nn.Module, patterns: Sequence[str]) -> dict[str, nn.Parameter]:
    """The parameters of `module` whose names match any glob pattern (fnmatch), in module order.

    Raises ValueError listing the parameter names when a pattern matches nothing.
    """
    names = [name for name, _ in module.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ValueError(
                f"inner.params pattern {pattern!r} matches no parameter; parameters are: {names}"
            )
    return {
        name: param
        for name, param in module.named_parameters()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    }


def functional_forward(module: nn.Module, params: Mapping[str, torch.Tensor], *args, **kwargs):
    """module(*args, **kwargs) with the tensors in `params` (by name) in place of those parameters;
    parameters not in `params` keep the module's own values."""
    return functional_call(module, dict(params), args, kwargs, strict=False)
