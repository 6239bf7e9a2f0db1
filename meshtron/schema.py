"""The config schema: every field of a config dataclass declares its type (the annotation) and
its range or allowed values (`setting(default, help=..., ge=..., choices=...)`), checked by one function.

Decision: one dataclass schema rather than Hydra structured configs. The dataclasses
(`GPTConfig`, `ParallelConfig`, `training.config.*`) are what the code already builds and
what tests, the planner and the HF importer construct directly, so their rules must hold
without Hydra; Hydra's own checks stop at types and would report in its own multi-line style.

One source per default and per description: `setting(default, help=..., **rule)` declares a
field's default, its one-line help and its range together; configs/train.yaml is written from
them (`python -m meshtron.configs.generate`, checked by tests/test_train_yaml.py), never by
hand. A dataclass that carries a key another one declares (GPTConfig's MoE routing keys are
MoEConfig's, TrainerConfig's execution keys ExecutionConfig's) copies that declaration with
`declared_in`, so a default or a help line exists once.

`field_checks(section, obj)` returns (holds, message) pairs for every field: the type (a bool
is not an int, an int is a number, floats must be finite), then the declared range and
choices. Messages name the key, the value and what is allowed:
`optim.lr=inf must be a finite number > 0`. Cross-field rules stay with their dataclass
(`validate` methods), each written once. `nearest_key` suggests the closest known key for a
typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from meshtron.rules import Check


@dataclass(frozen=True)
class Allowed:
    """A field's range (ge/gt/le/lt) or its allowed values (choices); `items` applies to each
    element of a list or tuple field."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    items: Allowed | None = None

    def holds(self, value) -> bool:
        if self.choices is not None and value not in self.choices:
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(_show(c) for c in self.choices)
        lower = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        upper = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if lower and upper:
            return f"in {lower}, {upper}"
        bounds = [
            f">= {self.ge}" if self.ge is not None else None,
            f"> {self.gt}" if self.gt is not None else None,
            f"<= {self.le}" if self.le is not None else None,
            f"< {self.lt}" if self.lt is not None else None,
        ]
        return " and ".join(b for b in bounds if b)


def setting(
    default: Any = dataclasses.MISSING, *, help: str, key: str | None = None, in_train_yaml: bool = True, **rule
) -> Any:
    """A config field: its default, its one-line `help` (the comment configs/train.yaml shows
    beside the key), its range or choices (`rule`: Allowed's arguments), the config `key` where
    the field name cannot be it (a Python keyword: checkpoint.async) and whether train.yaml
    lists the key. `in_train_yaml=False` writes it there commented out: the composed config
    lacks it, so a command line adds it with `+section.key=value` (Hydra refuses `+` for a key
    the yaml holds) and presets (configs/model/) set it."""
    metadata: dict[str, Any] = {"help": help}
    if rule:
        metadata["allowed"] = Allowed(**rule)
    if key is not None:
        metadata["key"] = key
    if not in_train_yaml:
        metadata["in_train_yaml"] = False
    return dataclasses.field(default=default, metadata=metadata)


def declared_in(owner: type, name: str) -> Any:
    """A new field with the default and metadata (help, range, key) of `owner`'s field `name`:
    how a second dataclass carrying the same key shares its one declaration. Only the type
    annotation is written again (tests/test_schema.py checks that it matches)."""
    f = owner.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)


def help_of(f: dataclasses.Field) -> str | None:
    """The one-line help `setting` declared for the field (None: none declared)."""
    return f.metadata.get("help")


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _type_matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = typing.get_args(hint)
        if origin is tuple and Ellipsis not in args:
            return len(value) == len(args) and all(_type_matches(v, a) for v, a in zip(value, args))
        return all(_type_matches(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe_type(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe_type(a) for a in typing.get_args(hint) if a is not type(None)]
        nullable = type(None) in typing.get_args(hint)
        return " or ".join(parts) + (" or null" if nullable else "")
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        count = f"{len(args)} " if origin is tuple and Ellipsis not in typing.get_args(hint) else ""
        noun = {int: "integers", float: "finite numbers", str: "strings", bool: "booleans"}.get(args[0], "values")
        return f"a list of {count}{noun}"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(
        hint, "a mapping" if origin is dict or hint is dict else getattr(hint, "__name__", str(hint))
    )


def field_checks(section: str, obj) -> list[Check]:
    """(holds, message) for the type and declared range of every field of the dataclass `obj`."""
    hints = typing.get_type_hints(type(obj))
    checks: list[Check] = []
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        rule: Allowed | None = f.metadata.get("allowed")
        key = f"{section}.{f.metadata.get('key', f.name)}={value!r}"  # metadata key: a keyword (checkpoint.async)
        if not _type_matches(value, hint):
            expected = _describe_type(hint)
            if rule is not None and rule.items is None:
                expected += " " + rule.describe()
            checks.append((False, f"{key} must be {expected}"))
            continue
        if rule is None or value is None:
            continue
        if rule.items is not None:
            bad = [v for v in value if not rule.items.holds(v)]
            checks.append((not bad, f"{key}: every element must be {rule.items.describe()}"))
        else:
            kind = _describe_type(_non_null(hint)) if rule.choices is None else ""
            checks.append((rule.holds(value), f"{key} must be {(kind + ' ') if kind else ''}{rule.describe()}"))
    return checks


def _non_null(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


def nearest_key(name: str, known) -> str | None:
    """The known key closest to `name` (a likely typo), or None when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return close[0] if close else None
