"""Serving benchmark: in-process TorchScript vs TorchServe REST+JSON vs gateway gRPC -> TorchServe.

``python -m serving.bench`` (part of ``make bench``) measures, in one run, requests of
``--examples`` (default 100) examples:

* **in-process**: ``torch.jit.load`` of the served artifact, one forward per request (the floor);
* **rest-json**: TorchServe's REST inference API with a JSON body (``{"instances": [...]}``),
  what a TorchServe user does by default;
* **gateway**: ``recsys.v1.Ranker/Score`` through the gateway, which validates and forwards the
  compact binary body over TorchServe's gRPC API;

at concurrency 1 and 4 (threads, each with its own connection), rounds interleaved so machine
noise hits all alike. Without ``--export``, it trains the ``criteo-kaggle`` preset's model
(MLPs 13-512-256-64-16 / 512-256-1, dim 16) with tables capped at ``--max-rows`` rows for a
few steps and exports it (subprocesses: serving never imports training).
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from recsys_stack.config import ConfigError, parse
from recsys_stack.net import free_ports
from serving.client import build_request
from serving.codec import to_rows
from serving.config import GatewayConfig
from serving.stubs import ranker_pb2_grpc
from serving.supervisor import launch_gateway, wait_serving
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig
from serving.torchserve.keys import inference_key

ROOT = Path(__file__).resolve().parents[1]


def build_model(workdir: Path, max_rows: int) -> Path:
    """Train criteo-kaggle-shaped for 3 steps on synthetic data and export it; returns the export dir."""
    rows = min(max_rows, 10_131_227)
    kaggle = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
              14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
    capped = [min(r, rows) for r in kaggle]
    run = workdir / "run"
    common = [f'data.cache_dir="{workdir / "cache"}"', f'data.synthetic_dir="{workdir / "syn"}"']
    subprocess.run(
        [sys.executable, "-m", "training.train", "--config", "training/configs/criteo-kaggle.toml",
         "--run-dir", str(run), "--no-progress", "--resume", "none", "train.max_steps=3",
         "train.batch_size=1024", "data.synthetic_rows=40000", f"model.num_embeddings={capped}", *common],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "training.export", "--run-dir", str(run), "--no-progress",
         "--model-store", str(workdir / "store"), "--name", "bench", "--version", "1", "--parity-rows", "4000"],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return run / "export"


def inputs(export: Path, examples: int) -> dict[str, Any]:
    s = np.load(export / "sample.npz")
    lengths = s["lengths"][:, :examples]
    sparse = to_rows(s["values"], s["lengths"])[:examples]
    dense = s["dense"][:examples]
    names = [f"C{i}" for i in range(1, 27)]
    instances = [
        {
            "dense": dense[i].tolist(),
            "sparse": {names[f]: [int(sparse[i, f])] for f in range(26) if sparse[i, f] >= 0},
        }
        for i in range(examples)
    ]
    return {
        "dense": dense,
        "sparse": sparse,
        "lengths": lengths,
        "json": json.dumps({"instances": instances}).encode(),
    }


def run_clients(
    call_factory: Callable[[], Callable[[], None]], concurrency: int, requests: int
) -> list[float]:
    """``requests`` calls split over ``concurrency`` threads; per-call latencies in ms."""
    latencies: list[float] = []
    lock = threading.Lock()
    per = requests // concurrency

    def worker() -> None:
        call = call_factory()
        call()  # warm the connection
        mine = []
        for _ in range(per):
            t0 = time.perf_counter()
            call()
            mine.append((time.perf_counter() - t0) * 1e3)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.append(-wall)  # smuggle the wall time out as a negative last entry
    return latencies


def summarize(lat: list[float], examples: int) -> dict[str, float]:
    wall = -lat[-1]
    ms = np.asarray(lat[:-1])
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "examples_per_s": len(ms) * examples / wall,
    }


@dataclass
class BenchConfig:
    export: Path | None = None
    """An export dir whose .mar is in model_store/ (default: train and export a model to bench)."""
    max_rows: int = 100_000
    """Table row cap of the model built when no export is given."""
    examples: int = 100
    """Examples per request."""
    requests: int = 400
    """Requests per method and concurrency in each round."""
    rounds: int = 2
    """Rounds; the methods are interleaved within each."""
    json: Path | None = None
    """Also write the figures here."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = parse(BenchConfig, argv, "python -m serving.bench", __doc__.split("\n\n")[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="serving-bench-", dir="/tmp"))
    procs: list[Any] = []
    try:
        export = ns.export or build_model(work, ns.max_rows)
        schema = json.loads((export / "schema.json").read_text())
        name, version = schema["model"]["name"], schema["model"]["version"]
        store = work / "store" if ns.export is None else Path("model_store")
        data = inputs(export, ns.examples)
        ports = free_ports(6)
        cfg = TorchServeConfig(
            inference_port=ports[0], management_port=ports[1], metrics_port=ports[2],
            grpc_inference_port=ports[3], grpc_management_port=ports[4], model_store=store,
            mar_file=f"{name}-{version}.mar", model_name=name, model_version=version, workdir=work / "ts",
            batch_size=4, max_batch_delay_ms=2,
        )  # fmt: skip
        torchserve = process.start(cfg)
        procs.append(torchserve)
        process.wait_ready(cfg, timeout=240, proc=torchserve)
        target = f"127.0.0.1:{ports[5]}"
        gcfg = GatewayConfig(
            schema=export / "schema.json", port=ports[5], backend=cfg.grpc_inference_target,
            key_file=str(cfg.key_file), deadline_s=10.0,
        )  # fmt: skip
        gateway = launch_gateway(gcfg, work / "gateway.log")
        procs.append(gateway)
        wait_serving(target, gateway, timeout=120)
        key = inference_key(cfg.key_file)
        methods = _methods(export, data, cfg, key, name, version, target)
        results: dict[str, dict[int, list[float]]] = {m: {1: [], 4: []} for m in methods}
        walls: dict[str, dict[int, float]] = {m: {1: 0.0, 4: 0.0} for m in methods}
        for _ in range(ns.rounds):
            for conc in (1, 4):
                for m, factory in methods.items():
                    if m == "in-process" and conc == 4:
                        continue
                    lat = run_clients(factory, conc, ns.requests)
                    walls[m][conc] += -lat[-1]
                    results[m][conc].extend(lat[:-1])
        table = {
            m: {
                c: summarize([*results[m][c], -walls[m][c]], ns.examples)
                for c in (1, 4)
                if results[m][c]
            }
            for m in methods
        }
        print(format_table(table, ns.examples, schema))
        if ns.json:
            ns.json.write_text(
                json.dumps(
                    {m: {str(c): v for c, v in t.items()} for m, t in table.items()}, indent=2
                )
            )
    finally:
        for proc in reversed(procs):
            if proc is procs[0]:
                process.stop(proc)
            else:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _methods(
    export: Path,
    data: dict[str, Any],
    cfg: TorchServeConfig,
    key: str,
    name: str,
    version: str,
    target: str,
) -> dict[str, Callable[[], Callable[[], None]]]:
    import fbgemm_gpu  # noqa: F401
    import torch

    def in_process() -> Callable[[], None]:
        model = torch.jit.load(str(export / "model_int8.pt"))
        present = data["sparse"] >= 0
        x = (
            torch.from_numpy(data["dense"]),
            torch.from_numpy(data["sparse"].T[present.T]),
            torch.from_numpy(present.T.astype(np.int32)),
        )

        def call() -> None:
            with torch.inference_mode():
                model(*x)

        return call

    def rest_json() -> Callable[[], None]:
        conn = http.client.HTTPConnection("127.0.0.1", cfg.inference_port, timeout=30)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

        def call() -> None:
            conn.request(
                "POST", f"/predictions/{name}/{version}", body=data["json"], headers=headers
            )
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"REST {resp.status}: {body[:200]!r}")

        return call

    request = build_request(data["dense"], data["sparse"])

    def gateway() -> Callable[[], None]:
        stub = ranker_pb2_grpc.RankerStub(grpc.insecure_channel(target))

        def call() -> None:
            stub.Score(request, timeout=30)

        return call

    return {"in-process": in_process, "rest-json": rest_json, "gateway": gateway}


def format_table(
    table: dict[str, dict[int, dict[str, float]]], examples: int, schema: dict[str, Any]
) -> str:
    lines = [
        f"requests of {examples} examples, model {schema['model']['name']} ({schema['served_variant']})",
        "",
    ]
    lines.append(f"{'method':<11} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'examples/s':>11}")
    for m, per in table.items():
        for c, v in per.items():
            lines.append(
                f"{m:<11} {c:>4} {v['p50_ms']:>8.2f} {v['p99_ms']:>8.2f} {v['examples_per_s']:>11,.0f}"
            )
    rest, gw = table["rest-json"], table["gateway"]
    lines.append("")
    lines.append(
        f"gateway p50 / rest-json p50 at concurrency 1 = {gw[1]['p50_ms'] / rest[1]['p50_ms']:.2f} (target <= 0.5)"
    )
    lines.append(
        f"gateway / rest-json examples/s at concurrency 4 = {gw[4]['examples_per_s'] / rest[4]['examples_per_s']:.2f} (target >= 1.5)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
