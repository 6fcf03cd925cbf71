"""One config mechanism for every entry point: a dataclass -> defaults < TOML < env < CLI.

A stage's config is a dataclass (nested dataclasses are TOML sections) with a docstring under
each field, ``Literal[...]`` for choices and ``env_field("RECSYS_...")`` where an environment
variable is part of the documented interface. :func:`add_config_args` gives an argparse parser
``--config FILE.toml``, one ``--flag`` per field (help = the field's docstring, default and
variable) and positional ``section.key=value`` overrides in TOML syntax; :func:`from_args` /
:func:`load` merge, in order of precedence::

    defaults < --config FILE.toml < environment variables < flags and section.key=value

and type-check the result. Unknown keys, bad values and bad variables are a
:class:`ConfigError` naming the key, where it came from, and the closest valid key.

No dependency beyond the standard library: the torch-free gateway and the load test use it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")
ENV = "env"  # dataclass field metadata key: the variable that sets the field
_OVERRIDES = "config_overrides"  # argparse dest collecting flags and key=value, in order


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


def _suggest(key: str, options: Sequence[str], prefix: str = "") -> str:
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
            raise ConfigError(f"unknown key '{path}'{_suggest(key, names, prefix)}")
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


# --- sources: file, environment, command line ----------------------------------------------------


def merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of TOML-shaped dicts (tables merge, everything else replaces)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _leaf_type(cls: type, dotted: str) -> Any:
    """The declared type at ``dotted`` (None when the path is not a field: reported later)."""
    tp: Any = cls
    for part in dotted.split("."):
        if _is_config(tp):
            tp = typing.get_type_hints(tp).get(part)
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
        if tp is None:
            return None
    return tp


def _textual(tp: Any) -> bool:
    """Fields whose command-line value is taken verbatim (no TOML parsing): str and Path."""
    if tp in (str, Path):
        return True
    args = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else ()
    return bool(args) and all(a in (str, Path, type(None)) for a in args)


def parse_value(cls: type, dotted: str, text: str) -> Any:
    """A value from the command line or environment: verbatim for str/Path fields, else TOML
    syntax (``3``, ``true``, ``[64, 16]``, ``"x"``), else the text itself."""
    tp = _leaf_type(cls, dotted)
    if _textual(tp):
        if text == "" and type(None) in typing.get_args(tp):
            return None
        if len(text) >= 2 and text[0] == text[-1] == '"':
            return tomllib.loads(f"v = {text}")["v"]
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if typing.get_origin(tp) in (list, tuple) and "," in text:  # 1,2,4 as well as [1, 2, 4]
        return [_scalar(t) for t in text.split(",") if t.strip()]
    return text


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    node: dict[str, Any] = {}
    cur = node
    parts = dotted.split(".")
    for p in parts[:-1]:
        cur[p] = cur = {}
    cur[parts[-1]] = value
    return node


def parse_override(cls: type, text: str) -> dict[str, Any]:
    """``section.key=value`` -> a nested dict; the value as in :func:`parse_value`."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override '{text}': expected section.key=value")
    return nest(key, parse_value(cls, key, raw))


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None


def env_values(cls: type, environ: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """``[(variable, nested dict)]`` for each documented variable that is set and not empty."""
    out = []
    for key in iter_keys(cls):
        if key.env and environ.get(key.env, "") != "":
            out.append((key.env, nest(key.path, parse_value(cls, key.path, environ[key.env]))))
    return out


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> T:
    """Defaults < TOML file < environment < ``section.key=value`` overrides, type-checked.

    ``environ``: the variables to read (default ``os.environ``; pass ``{}`` to ignore them).
    Errors name the source: the file, the variable, or "command line".
    """
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(path)
        try:
            build(cls, raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for var, value in env_values(cls, environ):
        raw = merge(raw, value)
        try:
            build(cls, raw)
        except ConfigError as e:
            raise ConfigError(f"environment {var}: {e}") from None
    for o in overrides:
        raw = merge(raw, parse_override(cls, o))
    try:
        return build(cls, raw)
    except ConfigError as e:
        raise ConfigError(f"command line: {e}") from None


# --- argparse ------------------------------------------------------------------------------------


def flag_name(path: str) -> str:
    """``limits.max_examples`` -> ``--limits.max-examples``."""
    return "--" + path.replace("_", "-")


class _Override(argparse.Action):
    """Collects ``--flag value`` as ``key=value`` in the shared, ordered override list."""

    def __init__(self, *args: Any, key: str, **kwargs: Any) -> None:
        self.key = key
        super().__init__(*args, **kwargs)

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: Any = None) -> None:
        items = list(getattr(ns, _OVERRIDES, None) or [])
        items.append(f"{self.key}={self.const if self.nargs == 0 else values}")
        setattr(ns, _OVERRIDES, items)


def _metavar(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (types.UnionType, typing.Union):
        return "|".join(_metavar(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        return f"[{_metavar(typing.get_args(tp)[0])},...]"
    return getattr(tp, "__name__", str(tp)).upper()


def _help(key: Key) -> str:
    default = key.default
    if isinstance(default, Path | str):
        default = str(default) or "''"
    parts = [key.doc.replace("%", "%%") or "(undocumented)"]
    parts.append(f"[default {default}]".replace("%", "%%"))
    if key.env:
        parts.append(f"[env {key.env}]")
    if key.type is bool:
        head, _, leaf = key.path.rpartition(".")
        parts.append(f"[off: {flag_name(f'{head}.no_{leaf}' if head else f'no_{leaf}')}]")
    return " ".join(parts)


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    flags: bool = True,
    default_file: Path | None = None,
) -> argparse.ArgumentParser:
    """Add ``--config``, a ``--flag`` per field of ``cls`` (``flags``) and ``section.key=value``.

    Flags and overrides land, in command-line order, in one list that :func:`from_args` applies
    after the file and the environment. Table-valued fields are set by override only.
    """
    parser.add_argument(
        "--config",
        type=Path,
        default=default_file,
        metavar="FILE.toml",
        help="TOML file with any of the keys below (tables = sections)"
        + (f" [default {default_file}]" if default_file else ""),
    )
    if flags:
        groups: dict[str, Any] = {}
        for key in iter_keys(cls):
            if typing.get_origin(key.type) is dict:
                continue
            section = key.path.rpartition(".")[0]
            if section not in groups:
                groups[section] = parser.add_argument_group(f"[{section}]") if section else parser
            group = groups[section]
            if key.type is bool:  # --flag / --no-flag: no value to swallow an override
                head, _, leaf = key.path.rpartition(".")
                negated = f"{head}.no_{leaf}" if head else f"no_{leaf}"
                group.add_argument(
                    flag_name(key.path), action=_Override, key=key.path, nargs=0,
                    const="true", default=argparse.SUPPRESS, help=_help(key),
                )  # fmt: skip
                group.add_argument(
                    flag_name(negated), action=_Override, key=key.path, nargs=0,
                    const="false", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                )  # fmt: skip
                continue
            group.add_argument(
                flag_name(key.path), action=_Override, key=key.path,
                metavar=_metavar(key.type), default=argparse.SUPPRESS, help=_help(key),
            )  # fmt: skip
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="any key in TOML syntax, applied after --config and the environment" + _example(cls),
    )
    return parser


def _example(cls: type) -> str:
    keys = list(iter_keys(cls))
    key = next((k for k in keys if "." in k.path), keys[0] if keys else None)
    if key is None or key.default is dataclasses.MISSING:
        return ""
    value = key.default
    shown = (
        f'"{value}"'
        if isinstance(value, str | Path)
        else str(value).lower()
        if isinstance(value, bool)
        else value
    )
    return f" (e.g. {key.path}={shown})".replace("%", "%%")


def overrides_from(ns: argparse.Namespace) -> list[str]:
    """The flags and positional overrides of a parsed command line, in order."""
    return [*(getattr(ns, _OVERRIDES, None) or []), *(getattr(ns, "overrides", None) or [])]


def from_args(cls: type[T], ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> T:
    """The config a command line parsed by :func:`add_config_args` asks for."""
    return load(cls, getattr(ns, "config", None), overrides_from(ns), environ)


def config_parser(cls: type, prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser with only the config arguments (``--config``, flags, overrides)."""
    p = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    return add_config_args(p, cls)


def parse(
    cls: type[T],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    environ: Mapping[str, str] | None = None,
) -> T:
    """``argv`` -> ``cls`` for entry points with no arguments of their own."""
    return from_args(cls, config_parser(cls, prog, description).parse_args(argv), environ)
