"""TorchServe's management API for one replica: register, describe, set the default, unregister.

Calls go to ``http://<host>:<management_port>`` with the management key of the replica's
``key_file.json`` (TorchServe 0.12, token authorization on, model API on: see
``serving/torchserve/config.py``). Standard library only. Errors are :class:`ManageError` with
TorchServe's own message and the replica named.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from serving.torchserve.config import TorchServeConfig, version_settings
from serving.torchserve.keys import KeyFileError, read_keys


class ManageError(RuntimeError):
    """A management call failed; the message names the replica and TorchServe's answer."""


def _call(cfg: TorchServeConfig, method: str, path: str, timeout: float = 30.0) -> tuple[int, Any]:
    url = f"http://{cfg.host}:{cfg.management_port}{path}"
    try:
        key = read_keys(cfg.key_file)["management"]
    except (KeyFileError, KeyError) as e:
        raise ManageError(f"{cfg.host}:{cfg.management_port}: no management key ({e})") from None
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):
            text = json.loads(text).get("message", text)
        return e.code, text
    except (OSError, ValueError) as e:
        raise ManageError(f"{cfg.host}:{cfg.management_port}: {method} {path}: {e}") from None


def describe(
    cfg: TorchServeConfig, model: str, version: str = "all", timeout: float = 30.0
) -> list[dict[str, Any]] | None:
    """TorchServe's description of ``model`` ``version`` ("all": every version) on this
    replica; None when it is not registered."""
    code, body = _call(cfg, "GET", f"/models/{model}/{version}", timeout)
    if code == 404:
        return None
    if code != 200:
        raise ManageError(
            f"{cfg.host}:{cfg.management_port}: describe {model} v{version}: {code} {body}"
        )
    out: list[dict[str, Any]] = body
    return out


def versions(cfg: TorchServeConfig, model: str) -> dict[str, int]:
    """``{version: READY workers}`` registered for ``model`` on this replica ({} if none)."""
    return {
        str(m["modelVersion"]): sum(w.get("status") == "READY" for w in m.get("workers", []))
        for m in describe(cfg, model) or []
    }


def register(cfg: TorchServeConfig, model: str, version: str, mar: str, timeout: float) -> None:
    """Register ``mar`` (a file in the replica's model store) as ``model`` ``version`` with the
    replica's worker settings; returns once its workers are READY (synchronous). Already
    registered = nothing to do."""
    if version in versions(cfg, model):
        return
    s = version_settings(cfg)
    query = urllib.parse.urlencode(
        {
            "url": mar,
            "model_name": model,
            "initial_workers": s["minWorkers"],
            "batch_size": s["batchSize"],
            "max_batch_delay": s["maxBatchDelay"],
            "response_timeout": s["responseTimeout"],
            "startup_timeout": s["startupTimeout"],
            "synchronous": "true",
        }
    )
    code, body = _call(cfg, "POST", f"/models?{query}", timeout=timeout)
    if code != 200:
        raise ManageError(
            f"{cfg.host}:{cfg.management_port}: register {mar} as {model} v{version}: {code} {body}"
        )
    got = versions(cfg, model)
    if version not in got:
        raise ManageError(
            f"{cfg.host}:{cfg.management_port}: {mar} registered, but {model} has versions "
            f"{sorted(got)}: the archive's manifest names another version than {version!r}"
        )


def wait_ready(cfg: TorchServeConfig, model: str, version: str, timeout: float) -> None:
    """Until ``version`` has a READY worker on this replica."""
    t0 = time.monotonic()
    while versions(cfg, model).get(version, 0) == 0:
        if time.monotonic() - t0 > timeout:
            raise ManageError(
                f"{cfg.host}:{cfg.management_port}: {model} v{version} has no READY worker "
                f"after {timeout:.0f} s"
            )
        time.sleep(0.5)


def set_default(cfg: TorchServeConfig, model: str, version: str) -> None:
    """Make ``version`` TorchServe's default for ``model`` (calls naming no version)."""
    code, body = _call(cfg, "PUT", f"/models/{model}/{version}/set-default")
    if code != 200:
        raise ManageError(
            f"{cfg.host}:{cfg.management_port}: set-default {model} v{version}: {code} {body}"
        )


def unregister(cfg: TorchServeConfig, model: str, version: str) -> None:
    """Unregister ``version`` (its workers stop); not registered = nothing to do."""
    code, body = _call(cfg, "DELETE", f"/models/{model}/{version}")
    if code not in (200, 404):
        raise ManageError(
            f"{cfg.host}:{cfg.management_port}: unregister {model} v{version}: {code} {body}"
        )
