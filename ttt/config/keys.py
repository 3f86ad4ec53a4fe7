"""Every key of a recipe's config with its type, value and the docstring its dataclass field carries
(what `python -m ttt.train recipe=NAME --help` prints)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
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


def optional_section(cls: type, name: str) -> type | None:
    """The dataclass D of field `name` of dataclass `cls` when the field is typed `D | None` (a section
    that is null unless given), else None."""
    try:
        hint = typing.get_type_hints(cls)[name]
    except (NameError, TypeError):  # an annotation that does not resolve here
        return None
    args = typing.get_args(hint)
    sections = [arg for arg in args if dataclasses.is_dataclass(arg)]
    return sections[0] if type(None) in args and len(sections) == 1 else None


def config_keys(cfg: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Rows (dotted key, type, value, doc) for every leaf field of dataclass instance `cfg`, sections
    (fields holding dataclasses) expanded in place, in declaration order. A section that is null
    unless given is listed as null, then its keys with their defaults when it is given."""
    rows = []
    docs = field_docs(type(cfg))
    for item in dataclasses.fields(cfg):
        value = getattr(cfg, item.name)
        key = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            rows += config_keys(value, f"{key}.")
            continue
        kind = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
        if isinstance(value, Enum):  # a Choice: show the values it takes
            kind = "one of " + " | ".join(str(member.value) for member in type(value))
        rows.append((key, kind, value, docs.get(item.name, "")))
        section = optional_section(type(cfg), item.name) if value is None else None
        if section is not None:
            rows += [
                (sub_key, sub_kind, sub_value, f"{sub_doc} (default once {key} is given)")
                for sub_key, sub_kind, sub_value, sub_doc in config_keys(section(), f"{key}.")
            ]
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
