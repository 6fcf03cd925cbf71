"""``python -m serving.bench``: the run, from config to table; servers always stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recsys_stack import logs
from recsys_stack.config import ConfigError, parse, to_dict
from recsys_stack.progress import progress
from serving.bench import methods as m
from serving.bench import servers
from serving.bench.config import FLOOR, LITE, LITE_GRPC, LITES, LOGGED, METHODS, BenchConfig
from serving.bench.measure import Cell, run_cell
from serving.bench.model import Model, build_model, payload
from serving.bench.report import results, settings_text, table
from serving.torchserve.keys import inference_key

logger = logging.getLogger(__name__)
DESCRIPTION = (
    "Serving benchmark: the served artifact in process (the floor), plain TorchServe as its"
    " users run it by default (REST + JSON, default workers, no batching), TorchServe's gRPC"
    " API with this project's handler, the same through a bare relay (the cost of a hop alone),"
    " and the gateway, interleaved on one model and machine."
)


def bench(cfg: BenchConfig, work: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Start the servers, run every cell ``cfg.rounds`` times; ``{"results", "settings"}``."""
    load_before = os.getloadavg()
    if cfg.export is None:
        logger.info("building a criteo-kaggle-shaped model (tables <= %d rows)", cfg.max_rows)
        export, store = build_model(work, cfg.max_rows)
    else:
        export, store = cfg.export, cfg.model_store
    model = Model.load(export)
    ts = dataclasses.replace(
        cfg.torchserve, model_store=store, mar_file=f"{model.name}-{model.version}.mar",
        model_name=model.name, model_version=model.version,
    )  # fmt: skip
    chosen: list[str] = [x for x in [*METHODS, LITE_GRPC, LOGGED] if x in cfg.methods or (
        x == LOGGED and cfg.feature_log)]  # fmt: skip
    # The benchmark measures what the servers do with the load it offers: the gateway's
    # admission budget covers the largest cell, so no call is refused as overload (plain
    # TorchServe queues them too). Overload behaviour has its own test (test_overload.py).
    need = max(cfg.sizes) * max(cfg.concurrency)
    limits = cfg.gateway.limits
    if limits.max_inflight_examples < need:
        gateway_cfg = dataclasses.replace(
            cfg.gateway, limits=dataclasses.replace(limits, max_inflight_examples=need)
        )
    else:
        gateway_cfg = cfg.gateway
    up = servers.start_all(
        model, ts, gateway_cfg, work, cfg.startup_timeout_s, stack,
        plain_threads=cfg.plain_threads if "plain-torchserve" in chosen else None,
        want_stack=bool({"torchserve-grpc", "relay", "gateway", LOGGED} & set(chosen)),
        want_gateway="gateway" in chosen, want_relay="relay" in chosen,
        want_logged=LOGGED in chosen, lite=[x for x in LITES if x in chosen],
    )  # fmt: skip
    settings = describe(cfg, model, up, chosen)
    connects = _connects(chosen, model, up, settings)
    payloads = {n: payload(model, n) for n in cfg.sizes}
    cells = {
        (x, n, c): Cell(x, n, c)
        for n in cfg.sizes
        for c in cfg.concurrency
        for x in chosen
        if x != FLOOR or c == 1
    }
    warm = min(4, max(cfg.concurrency))
    for x, connect in connects.items() if cfg.warmup else ():
        for p in payloads.values():
            run_cell(connect, p, 1 if x == FLOOR else warm, cfg.warmup)
    for x, connect in connects.items() if cfg.warmup_s else ():
        if x != FLOOR:
            logger.info("warming %s for %.0f s", x, cfg.warmup_s)
            end = time.monotonic() + cfg.warmup_s
            while time.monotonic() < end:
                for p in payloads.values():
                    run_cell(connect, p, warm, 8 * warm)
    servers_of = _servers_of(up.get("procs", {}))
    with progress(total=cfg.rounds * len(cells), desc="cells", unit="cell") as bar:
        for k in range(cfg.rounds):
            for (x, n, c), cell in in_order(cells, k):
                parts = servers_of.get(x, {})
                before = {k: servers.cpu_seconds(p) for k, p in parts.items()}
                client = time.process_time()  # this process: the client threads, nothing else
                busy, total = servers.machine_seconds()
                cell.add(*run_cell(connects[x], payloads[n], c, cfg.requests))
                busy_after, total_after = servers.machine_seconds()
                cell.add_machine(busy_after - busy, total_after - total)
                spent = {k: servers.cpu_seconds(p) - before[k] for k, p in parts.items()}
                if x != FLOOR:  # in-process, the "client" is the forward itself
                    spent["client"] = time.process_time() - client
                cell.add_cpu(spent)
                bar.update(1)
    settings["loadavg_before"], settings["loadavg_after"] = load_before, os.getloadavg()
    return {"results": results(list(cells.values())), "settings": settings}


def in_order(cells: dict[tuple[str, int, int], Cell], k: int) -> list[tuple[Any, Cell]]:
    """Round ``k``'s order: cell by cell, every method in turn (interleaved, so noise hits all
    alike), the methods' order reversed on odd rounds: a method never always runs right after
    another (on a stack still warming, or a machine whose load drifts, the second of a pair
    had the edge: docs/bench.md)."""
    out: list[tuple[Any, Cell]] = []
    for key in dict.fromkeys((n, c) for _, n, c in cells):
        row = [(x, cell) for (x, n, c), cell in cells.items() if (n, c) == key]
        out += [((x, *key), cell) for x, cell in (row[::-1] if k % 2 else row)]
    return out


def _servers_of(procs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The server process groups whose CPU each method's calls cost (the clients run here)."""
    out: dict[str, dict[str, Any]] = {}
    if "plain" in procs:
        out["plain-torchserve"] = {"torchserve": procs["plain"]}
    if "stack" in procs:
        out["torchserve-grpc"] = {"torchserve": procs["stack"]}
        if "relay" in procs:
            out["relay"] = {"relay": procs["relay"], "torchserve": procs["stack"]}
        if "gateway" in procs:
            out["gateway"] = {"gateway": procs["gateway"], "torchserve": procs["stack"]}
        if LOGGED in procs:
            out[LOGGED] = {"gateway": procs[LOGGED], "torchserve": procs["stack"]}
    for x in LITES:
        if x in procs:
            out[x] = {"gateway": procs[x], "lite": procs["lite"]}
    return out


def _connects(
    chosen: list[str], model: Model, up: dict[str, Any], settings: dict[str, Any]
) -> dict[str, m.Connect]:
    out: dict[str, m.Connect] = {}
    if FLOOR in chosen:
        out[FLOOR] = m.in_process(model, settings["methods"][FLOOR]["threads"])
    if "plain-torchserve" in chosen:
        p = up["plain"]
        path = f"/predictions/{p.model_name}/{p.model_version}"
        out["plain-torchserve"] = m.plain_rest(
            p.host, p.inference_port, path, inference_key(p.key_file)
        )
    if "torchserve-grpc" in chosen:
        s = up["stack"]
        out["torchserve-grpc"] = m.torchserve_grpc(
            s.grpc_inference_target, inference_key(s.key_file)
        )
    if "relay" in chosen:
        out["relay"] = m.torchserve_grpc(up["relay"], inference_key(up["stack"].key_file))
    for x in ("gateway", LOGGED, *LITES):
        if x in chosen:
            out[x] = m.gateway(f"127.0.0.1:{up[x].port}")
    return out


def _worker_threads(cfg: BenchConfig) -> int:
    """A stack worker's intra-op threads (the handler's own rule): the in-process floor's."""
    from serving.worker.handler import cpu_threads

    return cpu_threads(dict(os.environ), os.cpu_count() or 1, cfg.torchserve.worker_count())


def _gateway_settings(gcfg: Any) -> dict[str, Any]:
    """A bench gateway's settings, less what the bench sets per run (ports, backend, keys)."""
    set_here = ("schema", "host", "port", "backend", "key_file")
    return {k: v for k, v in to_dict(gcfg).items() if k not in set_here}


def describe(
    cfg: BenchConfig, model: Model, up: dict[str, Any], chosen: list[str]
) -> dict[str, Any]:
    """What ran where: the machine, the model, each method's server settings."""
    per: dict[str, dict[str, Any]] = {}
    if FLOOR in chosen:
        per[FLOOR] = {"threads": _worker_threads(cfg), "concurrency": 1}
    if "plain" in up:
        omp = cfg.plain_threads or "unset"
        per["plain-torchserve"] = {"api": "REST JSON", "OMP_NUM_THREADS": omp,
                                   **servers.model_settings(up["plain"])}  # fmt: skip
    if "stack" in up and "torchserve-grpc" in chosen:
        per["torchserve-grpc"] = {"api": "gRPC RSB1", **servers.model_settings(up["stack"])}
    if "relay" in up:
        per["relay"] = {"api": "gRPC RSB1 via serving/bench/relay.py",
                        **servers.model_settings(up["stack"])}  # fmt: skip
    for x in ("gateway", LOGGED):
        if x in up:
            per[x] = {"api": "gRPC Ranker/Score", **servers.model_settings(up["stack"]),
                      "gateway": _gateway_settings(up[x])}  # fmt: skip
    for x, door in ((LITE, "their Unix sockets"), (LITE_GRPC, "their gRPC API")):
        if x in up:
            per[x] = {"api": f"gRPC Ranker/Score -> serving.lite workers, {door}",
                      "workers": cfg.torchserve.worker_count(),
                      "gateway": _gateway_settings(up[x])}  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "model": {
            "name": model.name, "version": model.version,
            "served_variant": model.schema["served_variant"], "artifact": model.artifact.name,
            "plain_artifact": model.plain_artifact.name if "plain-torchserve" in cfg.methods else None,
            "table_rows": [t["rows"] for t in model.schema.get("tables", [])],
        },
        "sizes": cfg.sizes, "concurrency": cfg.concurrency,
        "requests_per_cell_and_round": cfg.requests, "rounds": cfg.rounds, "warmup_s": cfg.warmup_s,
        "methods": per,
    }  # fmt: skip


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ExitStack: every server stopped


def stopping_all(
    prefix: str, body: Callable[[Path, contextlib.ExitStack], dict[str, Any]]
) -> dict[str, Any] | int:
    """``body(work, stack)`` with a scratch folder ``/tmp/<prefix>...`` (removed after) and an
    ``ExitStack`` on which it registers every process it starts: all stopped on return, error,
    Ctrl-C or SIGTERM. Its result, or the exit code once the error is printed."""
    previous = signal.signal(signal.SIGTERM, _sigterm)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: TorchServe's sockets
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
            return body(work, stack)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``recsys-bench-serving``, ``make bench``)."""
    try:
        cfg = parse(BenchConfig, argv, "python -m serving.bench", DESCRIPTION)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs.configure(fmt="%(message)s")
    out = stopping_all("srvbench-", lambda work, stack: bench(cfg, work, stack))
    if isinstance(out, int):
        return out
    print(settings_text(out["settings"]))
    print()
    print(table(out["results"]))
    if cfg.json:
        cfg.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0
