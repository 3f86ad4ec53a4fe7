"""`Choice`: the base of every string choice in the configs (optimizer names, schedules, backends, ...).

A config field typed with a `Choice` subclass is checked by OmegaConf when a YAML or an override is
merged, and `load_config` turns a bad value into a ConfigError that lists the valid values. Members
are str-valued and behave as their value: `cfg.optimizer == "sgd"`, `f"{cfg.optimizer}"`, dict
lookups by the plain string, JSON and the dataclass's repr all see "sgd".

    class Schedule(Choice):
        constant = "constant"
        cosine = "cosine"
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A str-valued Enum whose members print, format, hash and repr as their value."""

    __repr__ = str.__repr__
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The valid values, in declaration order."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls, value, key: str):
        """The member of `value` (a member, its value or its name). Otherwise ValueError naming `key`: the
        class's reason when its `__refused__` mapping (value -> text) has one, else the valid values."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if value in (member.value, member.name):
                return member
        reason = getattr(cls, "__refused__", {}).get(value)
        if reason is not None:
            raise ValueError(f"{key}={value}{reason}")
        raise ValueError(f"{key} must be one of {', '.join(cls.values())}; got {value!r}")
