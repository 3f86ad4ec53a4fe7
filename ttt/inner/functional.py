"""Choosing parameters by name and calling a module with substituted parameters."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence

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


@contextlib.contextmanager
def substituted(module: nn.Module, params: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, module's parameters named in params (dotted names below module) are the given
    tensors, put in their slots as torch.func.functional_call does, without its walks of the module's
    tree (a chunk loop calls it per block and chunk). For parameters no other name shares: a tied weight's
    other names keep the module's own value (`functional_forward` substitutes them all). KeyError for a
    name that is not a parameter of module."""
    swapped = []
    try:
        for name, value in params.items():
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            if leaf not in sub._parameters:
                raise KeyError(f"{name!r} is not a parameter of {type(module).__name__}")
            swapped.append((sub, leaf, sub._parameters[leaf]))
            sub._parameters[leaf] = value
        yield
    finally:
        for sub, leaf, own in reversed(swapped):
            sub._parameters[leaf] = own


def shared_parameters(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Those of names (module's parameters) whose tensor module also holds under another name."""
    counts: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return [name for name in names if counts[id(module.get_parameter(name))] > 1]
