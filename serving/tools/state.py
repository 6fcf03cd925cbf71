"""What ``make serve`` recorded about the running stack (``<workdir>/serve.json``): read by the
supervisor (``make stop``/``status``), ``make rollout`` and the tools that default to the served
model's data (serving/tools/evaldata.py). No process is started or asked anything here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from recsys_model.atomic import write_atomic
from recsys_stack.config import build
from serving.gateway.config import GatewayConfig
from serving.torchserve.config import TorchServeConfig

STATE = "serve.json"
WORKDIR = Path("runs/serve")
WORKDIR_ENV = "RECSYS_SERVE_DIR"


def read_state(workdir: Path) -> dict[str, Any]:
    """``serve.json``'s contents (empty when nothing was started from ``workdir``)."""
    try:
        state: dict[str, Any] = json.loads((workdir / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state


def replicas(workdir: Path) -> list[TorchServeConfig]:
    """The TorchServe configs of the running stack's replicas (``make rollout`` manages them)."""
    return [
        build(TorchServeConfig, r["torchserve"]) for r in read_state(workdir).get("replicas", [])
    ]


def gateway_config(workdir: Path) -> GatewayConfig | None:
    """The running stack's gateway config (None when none was started)."""
    state = read_state(workdir)
    return build(GatewayConfig, state["gateway"]) if "gateway" in state else None


def kept_since(workdir: Path, version: str) -> float | None:
    """When the rollout that replaced ``version`` as the default kept it loaded (epoch
    seconds; None: not recorded as kept, e.g. by a rollout with ``keep_previous_s = 0``)."""
    kept = read_state(workdir).get("kept") or {}
    return float(kept["since"]) if kept.get("version") == version else None


def record_kept(workdir: Path, version: str | None) -> None:
    """Record ``version`` as the previous default kept loaded from now on (None: none is);
    serve.json is replaced whole (temp + rename), so a reader never sees half of it."""
    state = read_state(workdir)
    if not state:  # nothing started from here
        return
    if version:
        state["kept"] = {"version": version, "since": time.time()}
    else:
        state.pop("kept", None)
    write_atomic(workdir / STATE, json.dumps(state, indent=2) + "\n")


def local_target(cfg: GatewayConfig) -> str:
    """Where this machine reaches the gateway (a wildcard bind address is reached locally)."""
    host = "127.0.0.1" if cfg.host in ("", "0.0.0.0", "::") else cfg.host
    return f"{host}:{cfg.port}"
