"""Choosing parameters by name and calling a module with substituted parameters."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call


def select_by_glob(
    candidates: Mapping[str, torch.Tensor], patterns: Sequence[str], *, what: str = "parameter"
) -> dict[str, torch.Tensor]:
    """The candidates (name -> tensor) whose names match any glob pattern (fnmatch), in candidate order.

    Raises ValueError when a pattern matches nothing, naming the pattern, `what` the candidates are
    (e.g. "parameter of the suffix blocks (layers 1..2)") and every candidate's name.
    """
    for pattern in patterns:
        if not fnmatch.filter(candidates, pattern):
            raise ValueError(
                f"inner.params pattern {pattern!r} matches no {what}; they are: {list(candidates)}"
            )
    return {
        name: value
        for name, value in candidates.items()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    }


def select_parameters(module: nn.Module, patterns: Sequence[str]) -> dict[str, nn.Parameter]:
    """The parameters of `module` whose names match any glob pattern (fnmatch), in module order;
    ValueError listing the parameter names when a pattern matches nothing (`select_by_glob`)."""
    return select_by_glob(dict(module.named_parameters()), patterns)


def functional_forward(module: nn.Module, params: Mapping[str, torch.Tensor], *args, **kwargs):
    """module(*args, **kwargs) with the tensors in `params` (by name) in place of those parameters;
    parameters not in `params` keep the module's own values."""
    return functional_call(module, dict(params), args, kwargs, strict=False)
