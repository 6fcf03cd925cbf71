"""The best trial's config as a TOML the trainer takes: ``python -m training.train --config
<sweep>/best.toml`` (or ``make train`` with ``ARGS='--config <sweep>/best.toml'``).

It is the preset's TOML with the sweep's training overrides and the trial's values applied,
named ``<preset>-best`` (its runs go to runs/<preset>-best by default), with a header that says
where it came from. The writer covers what a training config holds (tables, strings, numbers,
booleans, arrays of them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from recsys_stack import config as shared
from training.config import Config, config_errors


def best_config(preset: Path, overrides: list[str], name: str) -> dict[str, Any]:
    """The preset's TOML as a dict with ``overrides`` (``key=value``) applied, and ``name``."""
    with config_errors():
        raw = shared.read_toml(preset)
        for item in overrides:
            raw = shared.merge(raw, shared.parse_override(Config, item))
    raw["name"] = name
    return raw


def dumps(table: dict[str, Any], prefix: str = "") -> str:
    """``table`` as TOML: its values first, then each sub-table under ``[prefix.key]``."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in table.items():
        if isinstance(v, dict):
            name = f"{prefix}.{_key(k)}" if prefix else _key(k)
            body = dumps(v, name)
            if any(not isinstance(x, dict) for x in v.values()) or not v:
                out += f"\n[{name}]\n"
            out += body
    return out


def _key(k: str) -> str:
    bare = k.replace("_", "").replace("-", "").isalnum() and k.isascii()
    return k if bare else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return (
            repr(v)
            if math.isfinite(v)
            else ("nan" if math.isnan(v) else f"{'-' if v < 0 else ''}inf")
        )
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__} {v!r}")


def write_best(
    path: Path, preset: Path, overrides: list[str], name: str, header: list[str]
) -> Path:
    """Write the best config to ``path`` (``header``: comment lines) and return it."""
    from recsys_model.atomic import write_atomic

    text = "".join(f"# {line}\n" for line in header) + dumps(best_config(preset, overrides, name))
    write_atomic(path, text, durable=False)
    return path
