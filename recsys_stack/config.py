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
import dataclasses
import difflib
import os
import sys
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from recsys_stack.typed import (
    ENV,
    ConfigError,
    Key,
    _is_config,
    build,
    env_field,
    field_docs,
    iter_keys,
    suggest,
    to_dict,
)

__all__ = [
    "ENV", "ArgumentParser", "ConfigError", "Key", "add_config_args", "build", "config_parser", "env_field",
    "field_docs", "from_args", "iter_keys", "load", "merge", "overrides_from", "parse",
    "parse_override", "to_dict",
]  # fmt: skip
T = TypeVar("T")
_OVERRIDES = "config_overrides"  # argparse dest collecting flags and key=value, in order

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
    is_list = typing.get_origin(tp) in (list, tuple)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
        return [value] if is_list and not isinstance(value, list) else value  # 100 = [100]
    except tomllib.TOMLDecodeError:
        pass
    if is_list:  # 1,2,4 as well as [1, 2, 4]
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
        # a preset is a file of its folder (make PRESET=...): name the ones there
        here = sorted(f.stem for f in p.parent.glob("*.toml")) if p.parent.is_dir() else []
        listing = f"; {p.parent} has {', '.join(here)}" if here else ""
        raise ConfigError(f"config file not found: {p}{suggest(p.stem, here)}{listing}")
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


def _blame(
    cls: type, base: dict[str, Any], env: list[tuple[str, dict[str, Any]]], error: ConfigError
) -> str:
    """The variable that alone gives ``error`` over ``base``, else every variable set."""
    for var, value in env:
        try:
            build(cls, merge(base, value))
        except ConfigError as e:
            if str(e) == str(error):
                return var
    return ", ".join(var for var, _ in env)


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> T:
    """Defaults < ``base`` < TOML file < environment < ``section.key=value`` overrides,
    type-checked.

    ``environ``: the variables to read (default ``os.environ``; pass ``{}`` to ignore them).
    ``base``: values under the file's (e.g. a checkpoint's recorded config).
    Errors name the source: the file, the variable, or "command line".
    """
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = dict(base or {})
    if path is not None:
        raw = merge(raw, read_toml(path))
        try:
            build(cls, raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    before_env, env = raw, env_values(cls, environ)
    for _, value in env:  # all of them, then one check: a rule may span fields (cert + key)
        raw = merge(raw, value)
    try:
        if env:
            build(cls, raw)
    except ConfigError as e:
        raise ConfigError(f"environment {_blame(cls, before_env, env, e)}: {e}") from None
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
    short: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """Add ``--config``, a ``--flag`` per field of ``cls`` (``flags``) and ``section.key=value``.

    ``short``: extra option strings by key (``{"users": "-u"}``), for tools whose users know
    them. Flags and overrides land, in command-line order, in one list that :func:`from_args` applies
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
                *([short[key.path]] if short and key.path in short else []),
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
    if key is None or key.default in (dataclasses.MISSING, None):
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


def command_name(default: str) -> str:
    """The command the user typed: the console script's name when this process is one
    (``recsys-gateway``, from ``sys.argv[0]``), else ``default`` (``python -m serving.gateway``:
    ``python -m`` and in-process callers such as tests)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name.startswith("recsys-") else default


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, a suggestion for a misspelled option, and ``prog`` (the
    ``usage:`` line) as the user typed the command (:func:`command_name`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("prog"):
            kwargs["prog"] = command_name(kwargs["prog"])
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            first = unknown.split()[0]
            options = [o for o in self._option_string_actions if o.startswith("--")]
            close = difflib.get_close_matches(first.split("=")[0], options, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            message = f"unrecognized option '{first}'{hint}"
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def config_parser(cls: type, prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser with only the config arguments (``--config``, flags, overrides)."""
    p = ArgumentParser(prog=prog, description=description, **kwargs)
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
