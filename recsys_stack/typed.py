"""Typed config trees: dataclasses with a docstring per field, built from TOML-shaped dicts.

The half of :mod:`recsys_stack.config` that knows types: which keys a config class has
(:func:`iter_keys`, with each field's docstring and environment variable), and
:func:`build`, which turns a dict into the dataclass or raises :class:`ConfigError` naming the
key and the closest valid one. Standard library only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")
ENV = "env"  # dataclass field metadata key: the variable that sets the field


class ConfigError(ValueError):
    """A config file, variable, flag or override is invalid; the message names the key."""


def env_field(var: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field that the environment variable ``var`` may set (see :func:`load`)."""
    metadata = {**kwargs.pop("metadata", {}), ENV: var}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


# --- introspection -----------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}``: the string literal under each annotated field of ``cls``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # no source (frozen app): no help text
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf of a config tree."""

    path: str  # dotted: "limits.max_examples"
    type: Any
    default: Any
    doc: str
    env: str | None


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def iter_keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every leaf field of ``cls`` (nested dataclasses flattened to dotted paths)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if _is_config(tp):
            yield from iter_keys(tp, f"{path}.")
        else:
            yield Key(path, tp, _default(f), docs.get(f.name, ""), f.metadata.get(ENV))


def suggest(key: str, options: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean '<prefix><closest>'?)`` when an option is close to ``key``, else ``""``."""
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


# --- dict -> dataclass, with type checks --------------------------------------------------------


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if _is_config(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table of keys, got {value!r}")
        return build(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(c) for c in typing.get_args(tp))
            raise ConfigError(f"{where} = {value!r}: must be one of {choices}")
        return value
    if origin in (types.UnionType, typing.Union):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        errors = []
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1])
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        item = typing.get_args(tp)[0]
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table of keys, got {value!r}")
        _, vt = typing.get_args(tp)
        return {k: _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is Path:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {value!r}: expected a path (a string)")
        return Path(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where} = {value!r}: expected {tp.__name__}")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")  # a bug in the config class


def build(cls: type[T], raw: Mapping[str, Any], where: str = "") -> T:
    """``raw`` (a TOML-shaped dict) -> ``cls``; unknown keys and bad types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"unknown key '{path}'{suggest(key, names, prefix)}")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as a TOML-shaped dict (paths as strings), e.g. to record it beside a run."""

    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))
