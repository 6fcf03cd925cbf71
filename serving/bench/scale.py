"""``make bench-scale``: what each stage costs as the tables grow, and serving in less memory.

For each total of table rows (``--rows``, default 1M, 4M, 16M and the Kaggle 33.8M; the 26
tables keep the Kaggle proportions, dim 16), in one run:

1. train the criteo-kaggle model for 2 steps on synthetic rows (one process: only its
   checkpoint matters here) and **export** it: seconds, peak RSS (the export process's
   ``ru_maxrss``), the export's own timings (tables, parity, archive), bytes on disk;
2. **serve** it (TorchServe, ``--workers`` workers, behind the gateway): seconds from start to
   every worker READY and to the gateway SERVING, each worker's PSS and the total
   (``/proc/<pid>/smaps_rollup``: shared pages count once), and a closed loop of
   ``--concurrency`` callers sending ``--requests`` of ``--distinct`` ``--examples``-example
   requests whose ids follow a Zipf (``--zipf``, default 1.15) law scattered over each table:
   examples/s, p99, failures, major page faults per 1,000 lookups (reads from disk). Its
   working set, the int8 table pages those requests touch, is computed from their ids;
3. serve it again **confined** to each of ``--fractions`` of the int8 table bytes: TorchServe
   is started inside a cgroup v1 memory group (:mod:`serving.bench.memgroup`: the JVM and the
   workers are born there, every page they touch charged to it); once READY the group is
   limited to the anonymous memory it holds then, plus 64 MiB a worker, plus that fraction of
   the tables. A fraction whose share the working set fits in is not run (it would confine
   nothing), and a run whose group never hit its limit (``memory.failcnt`` 0) prints no
   "confined" figures.

Both runs are born in a group (the unconfined one without a limit: its peak is what the
replica needed) and start cold: once READY the model files are dropped from the page cache.
Writes ``--out``/scale.json and scale.png and prints a table and, per size, confined against
unconfined. Needs root for the groups (the confined runs are skipped with a note otherwise).
Serving never imports training: the model is trained and exported in subprocesses.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
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
from serving.bench import memgroup
from serving.bench.measure import MIN_PER_CLIENT, run_cell
from serving.bench.memgroup import MemoryGroup
from serving.bench.methods import Connect
from serving.bench.model import KAGGLE_ROWS, ROOT
from serving.bench.scale_report import closing, confined_table, plot, table
from serving.bench.servers import start_gateway, wait_all_workers
from serving.gateway.config import GatewayConfig
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request, gateway_status
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, on_free_ports

HELP = (
    "make bench-scale: what export and serving cost as the tables grow (1M to the Kaggle 33.8M "
    "rows), and serving in less memory: each replica is born in a cgroup v1 memory group (the "
    "confined one limited, once READY, to its own memory + 64 MiB a worker + --fractions of "
    "the int8 tables); a fraction whose share holds the requests' working set is not run, and "
    "a run whose group never hit its limit prints no confined figures (docs/scale.md)."
)
KAGGLE_TOTAL = sum(KAGGLE_ROWS)
SLACK = 64 * 2**20  # a worker's room to allocate under load, in the confined group's limit
INT8_ROW = 16 + 8  # bytes of an int8 row at dim 16: the codes, then float32 scale and bias
PAGE = 4096


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
    requests: int = 4096
    """Requests per load run, spread over the callers (each from its own part of the list)."""
    zipf: float = 1.15
    """Exponent of the ids' Zipf law."""
    distinct: int = 4096
    """Distinct requests the load cycles through: their ids are the working set (at the
    Kaggle shape 512 touch 260 MiB of the 773 MiB int8 tables, 4096 touch 686 MiB)."""
    confine: bool = True
    """Also serve with the replica confined by a memory group (needs root)."""
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


@dataclass
class Load:
    """The requests of one size's load runs and the int8 table bytes they touch."""

    requests: list[Any]
    working_set: int
    """Bytes of the int8 table pages the requests sent read (:func:`working_set`)."""


def zipf_ids(rows: list[int], cfg: ScaleConfig) -> np.ndarray:
    """``int64[distinct, examples, 26]`` ids following Zipf(``cfg.zipf``), scattered over each
    table by a multiplicative hash (the hot ids are not the first rows)."""
    rng = np.random.default_rng(0)
    ranks = rng.zipf(cfg.zipf, (cfg.distinct, cfg.examples, len(rows))) - 1
    return ranks * 2654435761 % np.asarray(rows, dtype=np.int64)  # wraps: still deterministic


def sent(distinct: int, requests: int, concurrency: int) -> np.ndarray:
    """Indices of the requests a load run sends: caller ``i`` starts at ``i * distinct /
    concurrency`` (:func:`zipf_load`) and makes one warm-up call and ``run_cell``'s share."""
    per = max(MIN_PER_CLIENT, math.ceil(requests / concurrency)) + 1
    starts = np.arange(concurrency) * distinct // concurrency
    return np.unique((starts[:, None] + np.arange(per)[None, :]) % distinct)


def working_set(ids: np.ndarray, rows: list[int]) -> int:
    """Bytes of the distinct pages of the int8 tables file that ``ids [N, examples, 26]`` read
    (a row may straddle two pages: both count)."""
    offsets = np.cumsum([0, *rows[:-1]], dtype=np.int64)
    first = (ids + offsets) * INT8_ROW
    pages = np.unique(
        np.concatenate([(first // PAGE).ravel(), ((first + INT8_ROW - 1) // PAGE).ravel()])
    )
    return int(pages.size) * PAGE


def make_load(rows: list[int], cfg: ScaleConfig) -> Load:
    """The ``cfg.distinct`` requests and the working set of those a run sends."""
    ids = zipf_ids(rows, cfg)
    rng = np.random.default_rng(1)
    requests = [build_request(rng.integers(0, 100, (cfg.examples, 13)).astype(np.float32), x)
                for x in ids]  # fmt: skip
    used = sent(cfg.distinct, cfg.requests, cfg.concurrency)
    return Load(requests, working_set(ids[used], rows))


def zipf_load(target: str, requests: list[Any], concurrency: int) -> Connect:
    """The gateway method of serving.bench, cycling through ``requests``: the ``i``-th caller
    from ``i / concurrency`` of the way through them (:func:`sent`)."""
    callers = itertools.count()

    def connect(_: Any) -> tuple[Any, Any]:
        channel = grpc.insecure_channel(target)
        stub = ranker_pb2_grpc.RankerStub(channel).Score
        start = next(callers) * len(requests) // concurrency
        calls = itertools.cycle(requests[start:] + requests[:start])

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


def model_files(worker: int, mar: Path) -> list[Path]:
    """The files of the model TorchServe unpacked for ``worker`` (its tables among them) and
    the ``.mar``: what start-up read into the page cache."""
    tables = _tables_file(worker)
    return [mar, *(p for p in tables.parent.rglob("*") if p.is_file())]


def replica_group(label: str, stack: contextlib.ExitStack) -> MemoryGroup | None:
    """A memory group for one replica (removed after it stops), or None where none can be made."""
    if memgroup.unavailable():
        return None
    group = MemoryGroup(f"recsys-scale-{os.getpid()}-{label}")
    stack.callback(group.remove)  # registered first: runs after TorchServe has stopped
    return group


def serve(
    built: dict[str, Any], rows: list[int], cfg: ScaleConfig, work: Path, load: Load,
    fraction: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """The replica behind the gateway, born in a memory group: start-up seconds, memory, and
    the Zipf load's figures; ``fraction`` > 0: the group limited to its own memory, 64 MiB a
    worker and that fraction of the int8 tables."""
    ts = on_free_ports(TorchServeConfig(
        model_store=Path(built["store"]), workdir=work, model_name="scale", model_version="1",
        mar_file="scale-1.mar", workers=cfg.workers, response_timeout_s=120,
    ))  # fmt: skip
    out: dict[str, Any] = {"working_set_bytes": load.working_set}
    with contextlib.ExitStack() as stack:
        group = replica_group(f"{fraction:g}", stack)
        t0 = time.perf_counter()
        proc = process.start(ts, cgroup=group.procs if group else None)
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
        for path in model_files(workers[0], Path(built["store"]) / "scale-1.mar"):
            drop_cached(path)  # both runs start cold; the group holds the processes' own memory
        if group is not None:
            out["own_bytes"] = group.stat()["rss"]  # anonymous: the JVM's and the workers'
            if fraction:
                out["fraction"] = fraction
                out["limit_bytes"] = (out["own_bytes"] + SLACK * len(workers)
                                      + int(built["int8_table_bytes"] * fraction))  # fmt: skip
                group.limit(out["limit_bytes"])
            else:
                group.reset()
        faults = _major_faults(workers)
        connect = zipf_load(target, load.requests, cfg.concurrency)
        shape = SimpleNamespace(examples=cfg.examples)
        lat, wall, errors = run_cell(connect, shape, cfg.concurrency, cfg.requests)  # type: ignore[arg-type]
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
            stat = group.stat()
            out.update(peak_bytes=group.read("max_usage_in_bytes"), failcnt=group.read("failcnt"),
                       end_rss_bytes=stat["rss"], end_cache_bytes=stat["cache"])  # fmt: skip
            out["filled"] = bool(fraction) and out["failcnt"] > 0
    return out


def one_size(total: int, cfg: ScaleConfig) -> dict[str, Any]:
    rows = cardinalities(total)
    work = cfg.work / f"rows-{sum(rows)}"
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rows": sum(rows), **build(rows, work)}
    load = make_load(rows, cfg)
    result["serve"] = serve(result, rows, cfg, work / "ts", load)
    why = memgroup.unavailable()
    if cfg.confine and why:
        result["confined"] = {"skipped": why}
    elif cfg.confine:
        result["sweep"] = [confined_run(result, rows, cfg, work, load, f) for f in cfg.fractions]
        result["confined"] = result["sweep"][0]
    return result


def confined_run(
    built: dict[str, Any],
    rows: list[int],
    cfg: ScaleConfig,
    work: Path,
    load: Load,
    fraction: float,
) -> dict[str, Any]:
    """:func:`serve` confined to ``fraction``, unless the working set fits in its share (the
    limit could not bind: a skipped row saying so, nothing measured)."""
    room = int(built["int8_table_bytes"] * fraction) + SLACK * cfg.workers
    if load.working_set <= room:
        mib = 2**20
        return {"fraction": fraction, "working_set_bytes": load.working_set, "skipped": (
            f"the requests' working set ({load.working_set / mib:.0f} MiB of int8 table pages) "
            f"fits in the group's {room / mib:.0f} MiB beyond the replica's own memory: raise "
            "--distinct or lower --fractions")}  # fmt: skip
    return serve(built, rows, cfg, work / f"ts-{fraction:g}", load, fraction)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``make bench-scale``)."""
    try:
        cfg = parse(ScaleConfig, argv, "python -m serving.bench.scale", HELP)
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
    print(confined_table(results))
    print("\n".join(closing(r) for r in results))
    plot(results, cfg.out / "scale.png")
    print(f"wrote {cfg.out / 'scale.json'} and {cfg.out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
