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
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import psutil

from recsys_model.mapped import drop_cached
from recsys_stack import logs
from recsys_stack.config import ConfigError, parse
from serving.bench import memgroup
from serving.bench.measure import run_cell
from serving.bench.memgroup import MemoryGroup
from serving.bench.model import KAGGLE_ROWS, ROOT
from serving.bench.scale_load import Load, make_load, zipf_load
from serving.bench.scale_report import closing, confined_table, plot, table, variants_table
from serving.bench.servers import start_gateway, torchserve_backend, wait_all_workers
from serving.gateway.config import GatewayConfig
from serving.tools.client import gateway_status
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
    variants: list[Literal["int8", "int4", "mixed"]] = field(
        default_factory=lambda: ["int8", "int4", "mixed"]
    )
    """Table formats served, each exported and served (unconfined, then confined to the same
    memory as int8's: ``--fractions`` of the int8 table bytes) in turn: int8 (always, first),
    int4, mixed (per-table fp16/int8/int4 within ``--budget``)."""
    budget: float = 0.75
    """The mixed variant's memory budget, as a fraction of the int8 tables' bytes (int4's are
    0.5 of them at dim 16)."""
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
    """Train 2 steps and export (int8 served); the export's figures."""
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
        "export_s": seconds, "export_peak_rss": peak, "disk_bytes": disk, "run": str(run),
        "export_timings": json.loads((export / "timings.json").read_text()),
        "fp32_table_bytes": sum(rows) * 16 * 4,
        "int8_table_bytes": schema["variants"]["int8"]["tables"]["bytes"],
        "export": str(export), "store": str(store),
    }  # fmt: skip


def export_variant(
    built: dict[str, Any], variant: str, budget: float, work: Path
) -> dict[str, Any]:
    """Export ``built``'s run again serving ``variant`` (int4, or mixed within ``budget`` of the
    int8 table bytes) into its own model store: its table bytes, |ΔAUC| and export seconds."""
    store = work / f"store-{variant}"
    extra = ["--cpu-variant", "int4"] if variant == "int4" else [
        "--memory-budget", str(int(built["int8_table_bytes"] * budget))]  # fmt: skip
    seconds, _ = _run(["training.export", "--run-dir", built["run"], "--no-progress",
                       "--model-store", str(store), "--name", "scale", "--version", "1",
                       "--parity-rows", "4000", "--overwrite", "--formats", '["int8", "int4"]',
                       *extra], work / f"export-{variant}.log")  # fmt: skip
    export = Path(built["run"]) / "export"
    schema = json.loads((export / "schema.json").read_text())
    auc = json.loads((export / "parity.json").read_text())["auc"]
    reference = "eager" if "eager" in auc else "fp32"
    return {"variant": variant, "store": str(store), "export_s": seconds,
            "table_bytes": schema["variants"][variant]["tables"]["bytes"],
            "abs_delta_auc": abs(auc[variant] - auc[reference]), "reference": reference,
            "int8_abs_delta_auc": abs(auc["int8"] - auc[reference]),
            "formats": schema.get("memory_budget", {}).get("tables")}  # fmt: skip


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


def _tables_file(pid: int, name: str) -> Path:
    """The tables file ``name`` that ``pid`` maps (TorchServe's unpacked copy of the .mar's)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("/" + name):
            return Path(line.split(maxsplit=5)[5])
    raise RuntimeError(f"worker {pid} maps no {name}")


def model_files(worker: int, mar: Path, name: str = "tables_int8.bin") -> list[Path]:
    """The files of the model TorchServe unpacked for ``worker`` (its tables ``name`` among
    them) and the ``.mar``: what start-up read into the page cache."""
    tables = _tables_file(worker, name)
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
    fraction: float = 0.0, variant: str = "int8",
) -> dict[str, Any]:  # fmt: skip
    """The replica behind the gateway, born in a memory group: start-up seconds, memory, and
    the Zipf load's figures; ``fraction`` > 0: the group limited to its own memory, 64 MiB a
    worker and that fraction of the int8 tables (whatever ``variant`` it serves)."""
    tables = f"tables_{variant}.bin"
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
        gcfg, _ = start_gateway(
            gcfg, torchserve_backend(ts), gcfg.schema, work / "gateway.log", stack
        )
        target = f"127.0.0.1:{gcfg.port}"
        while gateway_status(target) != "SERVING":
            time.sleep(0.2)
        out["serving_s"] = time.perf_counter() - t0
        workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                   if "model_service_worker" in " ".join(p.cmdline())]  # fmt: skip
        for path in model_files(workers[0], Path(built["store"]) / "scale-1.mar", tables):
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
            tables_pss=pss(workers, tables),
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
    result["variants"] = [other_variant(result, rows, cfg, work, load, v)
                          for v in cfg.variants if v != "int8"]  # fmt: skip
    return result


def other_variant(
    built: dict[str, Any], rows: list[int], cfg: ScaleConfig, work: Path, load: Load, v: str
) -> dict[str, Any]:
    """``v`` exported and served like int8: unconfined, then confined to the int8 run's
    first fraction (the same limit: what it gains from smaller rows)."""
    out = export_variant(built, v, cfg.budget, work)
    served = {**built, "store": out["store"]}
    out["serve"] = serve(served, rows, cfg, work / f"ts-{v}", load, variant=v)
    c = built.get("confined", {})
    if cfg.confine and c and "skipped" not in c:
        out["confined"] = serve(served, rows, cfg, work / f"ts-{v}-{c['fraction']:g}", load,
                                c["fraction"], v)  # fmt: skip
    return out


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
    print(variants_table(results))
    print("\n".join(closing(r) for r in results))
    plot(results, cfg.out / "scale.png")
    print(f"wrote {cfg.out / 'scale.json'} and {cfg.out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
