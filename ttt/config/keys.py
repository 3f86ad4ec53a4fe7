"""Every key of a recipe's config with its type, value and the docstring its dataclass field carries
(what `python -m ttt.train recipe=NAME --help` prints)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from enum import Enum
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written under it in the class body, for dataclass `cls` and
    the dataclasses it inherits from (a subclass's doc wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (e.g. a class built at run time)
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_keys(cfg: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Rows (dotted key, type, value, doc) for every leaf field of dataclass instance `cfg`, sections
    (fields holding dataclasses) expanded in place, in declaration order."""
    rows = []
    docs = field_docs(type(cfg))
    for item in dataclasses.fields(cfg):
        value = getattr(cfg, item.name)
        key = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            rows += config_keys(value, f"{key}.")
        else:
            kind = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
            if isinstance(value, Enum):  # a Choice: show the values it takes
                kind = "one of " + " | ".join(str(member.value) for member in type(value))
            rows.append((key, kind, value, docs.get(item.name, "")))
    return rows


def _yaml_value(value: Any) -> str:
    """A value as it is written on the command line (null, true / false, an Enum's value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "value", value))


def format_config_keys(cfg: Any, width: int = 100) -> str:
    """`config_keys` as text: `key: type = value` lines, each followed by its doc, indented."""
    lines = []
    for key, kind, value, doc in config_keys(cfg):
        shown = _yaml_value(value)
        lines.append(f"  {key}: {kind} = {shown}")
        indent = " " * 6
        lines += textwrap.wrap(" ".join(doc.split()), width, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)
