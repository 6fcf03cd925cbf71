"""``make bench-scale``: what each stage costs as the tables grow, and serving at half memory.

For each total of table rows (``--rows``, default 1M, 4M, 16M and the Kaggle 33.8M; the 26
tables keep the Kaggle proportions, dim 16), in one run:

1. train the criteo-kaggle model for 2 steps on synthetic rows (one process: only its
   checkpoint matters here) and **export** it: seconds, peak RSS (the export process's
   ``ru_maxrss``), the export's own timings (tables, parity, archive), bytes on disk;
2. **serve** it (TorchServe, ``--workers`` workers, behind the gateway): seconds from start to
   every worker READY and to the gateway SERVING, each worker's PSS and the total
   (``/proc/<pid>/smaps_rollup``: shared pages count once), and a closed loop of
   ``--concurrency`` callers sending ``--examples``-example requests whose ids follow a Zipf
   (``--zipf``, default 1.15) law scattered over each table: examples/s, p99, failures;
3. serve it again **confined** (``--confine``): once READY, its workers moved into a cgroup
   v1 memory group of half the int8 table bytes plus 64 MB a worker, the tables file dropped
   from the page cache first, so every table row they read from then on is charged to that
   group (what they held before stays charged where it was: this kernel moves no charge), and
   the same load; major page faults per 1,000 lookups tell the cold reads.

Writes ``--out``/scale.json and scale.png (cost vs table size) and prints a table. Needs root
for the cgroup (skipped with a note otherwise). Serving never imports training: the model is
trained and exported in subprocesses.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import psutil

from recsys_model.mapped import drop_cached
from recsys_stack import logs
from recsys_stack.config import ConfigError, parse
from serving.bench.measure import run_cell
from serving.bench.methods import Connect
from serving.bench.model import KAGGLE_ROWS, ROOT
from serving.bench.servers import start_gateway, wait_all_workers
from serving.gateway.config import GatewayConfig
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request, gateway_status
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, on_free_ports

KAGGLE_TOTAL = sum(KAGGLE_ROWS)
CGROUP = Path("/sys/fs/cgroup/memory")


@dataclass
class ScaleConfig:
    """``python -m serving.bench.scale`` (``make bench-scale``)."""

    rows: list[int] = field(default_factory=lambda: [1_000_000, 4_000_000, 16_000_000, 0])
    """Total table rows per model (0 = the Kaggle cardinalities, 33.76M)."""
    workers: int = 2
    """TorchServe workers of the replica."""
    concurrency: int = 8
    """Closed-loop callers through the gateway."""
    examples: int = 100
    """Examples per request."""
    requests: int = 3000
    """Requests per load run (spread over the callers)."""
    zipf: float = 1.15
    """Exponent of the ids' Zipf law."""
    distinct: int = 512
    """Distinct requests the load cycles through (their ids are the working set)."""
    confine: bool = True
    """Also serve with the workers' table reads confined by a cgroup (needs root)."""
    fractions: list[float] = field(default_factory=lambda: [0.5])
    """Fractions of the int8 table bytes the confined runs allow (the first is the table's
    'confined' column; more map hot-set size to page faults and throughput)."""
    work: Path = Path("/tmp/bench-scale")
    """Scratch folder (checkpoints, exports, model stores: several GB at the Kaggle size)."""
    out: Path = Path("reports/bench-scale")
    """Where scale.json and scale.png go."""


def cardinalities(total: int) -> list[int]:
    """The Kaggle tables scaled to ``total`` rows (each at least 2); 0 = Kaggle's own."""
    if total == 0:
        return list(KAGGLE_ROWS)
    return [max(2, round(r * total / KAGGLE_TOTAL)) for r in KAGGLE_ROWS]


def _run(args: list[str], log: Path) -> tuple[float, int]:
    """``python -m args`` -> (seconds, peak RSS bytes of it and its children); raises on failure."""
    wrapper = (
        "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
        "sys.exit(rc)"
    )
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", *args],
                              cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    lines = proc.stderr.strip().splitlines()
    with log.open("a") as f:
        f.write("\n".join(lines))
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {args[0]} exited {proc.returncode}; see {log}")
    return seconds, int(lines[-1]) * 1024


def build(rows: list[int], work: Path) -> dict[str, Any]:
    """Train 2 steps and export; the export's figures."""
    run, store = work / "run", work / "store"
    data = [
        f'data.cache_dir="{work.parent / "cache"}"',
        f'data.synthetic_dir="{work.parent / "syn"}"',
    ]
    _run(["training.train", "--config", "training/configs/criteo-kaggle.toml", "--run-dir",
          str(run), "--no-progress", "--resume", "none", "train.max_steps=2",
          "train.batch_size=1024", "data.synthetic_rows=40000", f"model.num_embeddings={rows}",
          *data], work / "train.log")  # fmt: skip
    seconds, peak = _run(["training.export", "--run-dir", str(run), "--no-progress",
                          "--model-store", str(store), "--name", "scale", "--version", "1",
                          "--parity-rows", "4000", "--overwrite"], work / "export.log")  # fmt: skip
    export = run / "export"
    disk = sum(p.stat().st_size for p in export.iterdir()) + (store / "scale-1.mar").stat().st_size
    schema = json.loads((export / "schema.json").read_text())
    return {
        "export_s": seconds, "export_peak_rss": peak, "disk_bytes": disk,
        "export_timings": json.loads((export / "timings.json").read_text()),
        "fp32_table_bytes": sum(rows) * 16 * 4,
        "int8_table_bytes": schema["variants"]["int8"]["tables"]["bytes"],
        "export": str(export), "store": str(store),
    }  # fmt: skip


def zipf_requests(rows: list[int], cfg: ScaleConfig, count: int = 64) -> list[Any]:
    """``count`` ScoreRequests whose ids follow Zipf(``cfg.zipf``), scattered over each table
    by a multiplicative hash (the hot ids are not the first rows)."""
    rng = np.random.default_rng(0)
    b, out = cfg.examples, []
    for _ in range(count):
        sparse = np.stack([(rng.zipf(cfg.zipf, b) - 1) * 2654435761 % r for r in rows], axis=1)
        out.append(build_request(rng.integers(0, 100, (b, 13)).astype(np.float32), sparse))
    return out


def zipf_load(target: str, requests: list[Any]) -> Connect:
    """The gateway method of serving.bench, cycling through ``requests`` (each caller from
    its own offset)."""

    def connect(_: Any) -> tuple[Any, Any]:
        channel = grpc.insecure_channel(target)
        stub = ranker_pb2_grpc.RankerStub(channel).Score
        calls = itertools.cycle(requests[random.randrange(len(requests)) :] + requests)

        def call() -> int:
            return len(stub(next(calls), timeout=60).scores)

        return call, channel.close

    return connect


def pss(pids: Sequence[int], name: str = "") -> int:
    """Summed PSS bytes of ``pids``: all of it, or of their mappings of files named ``name``."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            if not name:
                text = Path(f"/proc/{pid}/smaps_rollup").read_text().split()
                total += int(text[text.index("Pss:") + 1]) * 1024
                continue
            inside = False
            for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
                f = line.split()
                if len(f) >= 5 and "-" in f[0] and ":" in f[3]:  # a mapping's header
                    inside = f[-1].endswith("/" + name)
                elif inside and f[0] == "Pss:":
                    total += int(f[1]) * 1024
    return total


def _major_faults(pids: Sequence[int]) -> int:
    """Major page faults of ``pids`` so far (reads from disk: the cold rows)."""
    return sum(int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[9]) for p in pids)


def _tables_file(pid: int) -> Path:
    """The int8 tables file ``pid`` maps (TorchServe's unpacked copy of the .mar's)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("/tables_int8.bin"):
            return Path(line.split(maxsplit=5)[5])
    raise RuntimeError(f"worker {pid} maps no tables_int8.bin")


@contextlib.contextmanager
def confined(workers: Sequence[int], limit: int) -> Iterator[Path]:
    """``workers`` in a cgroup v1 memory group of ``limit`` bytes, the tables file dropped from
    the page cache first (the rows they fault in from then on are charged to the group)."""
    group = CGROUP / f"recsys-scale-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    drop_cached(_tables_file(workers[0]))  # the pages no worker maps now
    for pid in workers:
        (group / "cgroup.procs").write_text(str(pid))
    try:
        yield group
    finally:
        parent = CGROUP / "cgroup.procs"
        for member in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                parent.write_text(member)
        group.rmdir()


def serve(
    built: dict[str, Any], rows: list[int], cfg: ScaleConfig, work: Path, fraction: float = 0.0
) -> dict[str, Any]:
    """The replica behind the gateway: start-up seconds, memory, and the Zipf load's figures;
    ``fraction`` > 0: its workers' table reads confined to that fraction of the int8 tables."""
    ts = on_free_ports(TorchServeConfig(
        model_store=Path(built["store"]), workdir=work, model_name="scale", model_version="1",
        mar_file="scale-1.mar", workers=cfg.workers, response_timeout_s=120,
    ))  # fmt: skip
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        proc = process.start(ts)
        stack.callback(process.stop, proc)
        wait_all_workers(ts, proc, 900)
        out["ready_s"] = time.perf_counter() - t0
        gcfg = GatewayConfig(schema=Path(built["export"]) / "schema.json")
        gcfg, _ = start_gateway(gcfg, ts, gcfg.schema, work / "gateway.log", stack)
        target = f"127.0.0.1:{gcfg.port}"
        while gateway_status(target) != "SERVING":
            time.sleep(0.2)
        out["serving_s"] = time.perf_counter() - t0
        workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                   if "model_service_worker" in " ".join(p.cmdline())]  # fmt: skip
        group = None
        if fraction:  # what they allocate from now on (their memory so far stays charged
            # where it was: cgroup v1 moves no charge on this kernel), and the tables' share
            out["fraction"] = fraction
            out["limit_bytes"] = 64 * 2**20 * len(workers) + int(
                built["int8_table_bytes"] * fraction
            )
            group = stack.enter_context(confined(workers, out["limit_bytes"]))
        faults = _major_faults(workers)
        load = zipf_load(target, zipf_requests(rows, cfg, cfg.distinct))
        shape = SimpleNamespace(examples=cfg.examples)
        lat, wall, errors = run_cell(load, shape, cfg.concurrency, cfg.requests)  # type: ignore[arg-type]
        group_pids = [p.pid for p in process.group_members(proc.pid)]
        lookups = len(lat) * cfg.examples * len(rows)
        out.update(
            worker_pss=[pss([w]) for w in workers], total_pss=pss(group_pids),
            tables_pss=pss(workers, "tables_int8.bin"),
            major_faults_per_1k_lookups=1e3 * (_major_faults(workers) - faults) / max(lookups, 1),
            examples_per_s=len(lat) * cfg.examples / wall,
            p99_ms=float(np.percentile(lat, 99)) if lat else None,
            failed=len(errors), first_error=errors[0] if errors else "",
        )  # fmt: skip
        if group is not None:
            out["peak_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
    return out


def one_size(total: int, cfg: ScaleConfig) -> dict[str, Any]:
    rows = cardinalities(total)
    work = cfg.work / f"rows-{sum(rows)}"
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rows": sum(rows), **build(rows, work)}
    result["serve"] = serve(result, rows, cfg, work / "ts")
    if cfg.confine and os.access(CGROUP, os.W_OK):
        result["sweep"] = [serve(result, rows, cfg, work / f"ts-{f}", f) for f in cfg.fractions]
        result["confined"] = result["sweep"][0]
    elif cfg.confine:
        result["confined"] = {"skipped": f"{CGROUP} is not writable (needs root)"}
    return result


def table(results: list[dict[str, Any]]) -> str:
    gb = 2**30
    head = ("rows", "fp32 GB", "export s", "peak RSS", "disk GB", "ready s", "SERVING s",
            "PSS/worker", "total PSS", "ex/s", "p99 ms", "confined ex/s", "p99", "failed")  # fmt: skip
    lines = [" | ".join(head)]
    for r in results:
        s, c = r["serve"], r.get("confined", {})
        lines.append(" | ".join([
            f"{r['rows'] / 1e6:.1f}M", f"{r['fp32_table_bytes'] / gb:.2f}", f"{r['export_s']:.0f}",
            f"{r['export_peak_rss'] / gb:.2f}", f"{r['disk_bytes'] / gb:.2f}",
            f"{s['ready_s']:.0f}", f"{s['serving_s']:.0f}",
            "/".join(f"{w / gb:.2f}" for w in s["worker_pss"]), f"{s['total_pss'] / gb:.2f}",
            f"{s['examples_per_s']:,.0f}", f"{s['p99_ms']:.0f}",
            f"{c.get('examples_per_s', 0):,.0f}", f"{c.get('p99_ms') or 0:.0f}",
            f"{s['failed']}/{c.get('failed', '-')}",
        ]))  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    gb = 2**30
    x = [r["fp32_table_bytes"] / gb for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (
        ("export_peak_rss", "export peak RSS"),
        ("disk_bytes", "export + .mar on disk"),
    ):
        a.plot(x, [r[key] / gb for r in results], "o-", label=label)
    a.plot(
        x, [r["serve"]["total_pss"] / gb for r in results], "o-", label="replica PSS (all workers)"
    )
    a.plot(x, x, "k:", label="fp32 tables")
    a.set(xlabel="fp32 table GiB", ylabel="GiB", title="cost vs table size")
    a.legend()
    b.plot(x, [r["serve"]["examples_per_s"] for r in results], "o-", label="unconfined")
    b.plot(x, [r.get("confined", {}).get("examples_per_s", np.nan) for r in results], "o-",
           label="half the tables in memory")  # fmt: skip
    b.set(xlabel="fp32 table GiB", ylabel="examples/s", title="serving through the gateway (Zipf)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``make bench-scale``)."""
    try:
        cfg = parse(ScaleConfig, argv, "python -m serving.bench.scale", __doc__.split("\n\n")[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs.configure(fmt="%(message)s")
    cfg.out.mkdir(parents=True, exist_ok=True)
    results = []
    for total in cfg.rows:
        results.append(one_size(total, cfg))
        (cfg.out / "scale.json").write_text(json.dumps(results, indent=2))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    plot(results, cfg.out / "scale.png")
    print(f"wrote {cfg.out / 'scale.json'} and {cfg.out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
