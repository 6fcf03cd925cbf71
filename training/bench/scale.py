"""``make bench-scale``, training side: preprocessing and training at the Kaggle shape.

On ``--rows`` synthetic Kaggle-shaped rows (13 dense and 26 categorical fields; the
generator's Criteo-like vocabularies; ids hashed into the preset's tables, the Kaggle ones by
default), in one run:

1. **preprocessing** rows/s with 1 process and with ``--processes`` (0 = one per core),
   interleaved (1, N, 1, N, ...) for ``--repeats`` rounds, each into a fresh cache (the median
   per kind and their ratio), then a byte-for-byte comparison of the two caches;
2. **cache** bytes per row, from the files on disk;
3. **training** samples/s of the real ``training.train`` under torchrun for each
   ``--topologies`` entry (``1x2``: one node with 2 ranks, ``torchrun --standalone``; ``2x1``: 2
   single-rank torchruns meeting by c10d rendezvous on this machine), measured the same way for
   all: the trainer's own ``samples_per_sec`` of each ``--window``-step evaluation window
   (``train.eval_every``; periodic evaluations on one global batch are outside the windows),
   the first window being warm-up; the median of the ``--windows`` after it.

Each measurement records the CPU seconds other processes used meanwhile (``/proc/stat`` minus
its own); the table warns when they took over 10% of the machine. Writes
``--out``/scale-training.json and scale-training.png and prints a table. The serving side of
``make bench-scale`` is ``python -m serving.bench.scale``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import logging
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from recsys_stack import config as shared
from recsys_stack import logs
from recsys_stack.net import free_ports
from training.bench.scale_report import plot, table
from training.config import load_config
from training.data.build import cpu_cores, preprocess
from training.data.parts import PART_BYTES, plan_parts
from training.data.synthetic import SyntheticSpec, generate
from training.errors import RecsysError
from training.metrics.log import read_metrics
from training.train import parse_args, prepare

logger = logging.getLogger("training.bench.scale")
ROOT = Path(__file__).resolve().parents[1]
Stage = Literal["preprocess", "train"]
EPILOG = """examples:
  make bench-scale SCALE_STAGES=training SCALE_TRAIN_ARGS='--rows 1000000'
  python -m training.bench.scale --stages preprocess --repeats 5
  python -m training.bench.scale --topologies 1x2 --train-overrides train.pipeline=base

Run it alone on the machine: other load changes every figure (the JSON records the load
average before and after)."""
EVAL_FRACTION = 0.01  # held out by the training runs: their final evaluation is not timed


@dataclass
class TrainScaleConfig:
    """``python -m training.bench.scale`` (``make bench-scale``)."""

    rows: int = 3_000_000
    """Synthetic Kaggle-shaped rows to preprocess and train on."""
    preset: Path = Path("training/configs/criteo-kaggle.toml")
    """Training preset: its tables (ids are hashed into them), model and global batch."""
    stages: list[Stage] = field(default_factory=lambda: ["preprocess", "train"])
    """Stages to run (train alone preprocesses its data as `make train` does, unmeasured)."""
    processes: int = 0
    """Processes of the parallel preprocessing (0 = one per core)."""
    repeats: int = 5
    """Preprocessing rounds, each one single-process and one parallel run (median reported)."""
    part_bytes: int = PART_BYTES
    """Bytes of TSV per preprocessing part (the unit the processes share out)."""
    topologies: list[str] = field(default_factory=lambda: ["1x2", "2x1"])
    """Training launches as NODESxRANKS: 1xN is one torchrun, Mx1 are M torchruns meeting by
    c10d rendezvous on this machine."""
    window: int = 50
    """Training steps per measured window (train.eval_every)."""
    windows: int = 3
    """Measured windows per topology, after one warm-up window (median reported)."""
    batch_size: int = 0
    """Global training batch (0 = the preset's)."""
    train_overrides: list[str] = field(default_factory=list)
    """More section.key=value overrides of the training runs (comma-separated on the command
    line), e.g. train.pipeline=base."""
    timeout_s: int = 3600
    """Seconds a training launch may take before it is killed."""
    work: Path = Path("/tmp/bench-scale-training")
    """Scratch folder: the synthetic TSV (kept for reuse), caches, run folders, logs."""
    out: Path = Path("reports/bench-scale")
    """Where scale-training.json and scale-training.png go."""


# ---------------------------------------------------------------------------------------------
# preprocessing and the cache


def synthetic_tsv(cfg: TrainScaleConfig) -> Path:
    """The Kaggle-shaped TSV of ``cfg.rows`` rows (and its prob sidecar), generated once."""
    tsv = cfg.work / "data" / f"kaggle-shaped-{cfg.rows}.tsv"
    if not tsv.is_file():
        logger.info("generating %d synthetic rows into %s", cfg.rows, tsv)
        generate(SyntheticSpec(rows=cfg.rows), tsv, progress=False)
    return tsv


def _cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have ended."""
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def machine_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat; 0 where
    there is none): what other processes took during a measurement is its change minus ours."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait


def _one_build(
    tsv: Path, out: Path, tables: list[int], processes: int, part_bytes: int
) -> dict[str, Any]:
    """One preprocessing of ``tsv`` into a fresh ``out``: its seconds, CPU and rows/s."""
    shutil.rmtree(out, ignore_errors=True)
    cpu, machine, t0 = _cpu_seconds(), machine_cpu_seconds(), time.perf_counter()
    meta = preprocess([tsv], out, progress=False, rows_per_table=tables, processes=processes,
                      part_bytes=part_bytes)  # fmt: skip
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu
    return {
        "seconds": seconds, "cpu_s": cpu, "rows": meta.rows,
        "others_cpu_s": max(0.0, machine_cpu_seconds() - machine - cpu),
        "rows_per_sec": meta.rows / seconds, "layout_bytes_per_row": meta.bytes_per_row(),
    }  # fmt: skip


def preprocess_stage(cfg: TrainScaleConfig, tsv: Path, tables: list[int]) -> dict[str, Any]:
    """Single-process and parallel preprocessing of ``tsv``, interleaved; figures and the
    comparison of the last cache of each kind."""
    parts = len(plan_parts([tsv], cfg.part_bytes))
    kinds = {"single": 1, "parallel": cfg.processes or cpu_cores()}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(cfg.repeats):
        for kind, processes in kinds.items():
            out = cfg.work / f"cache-{kind}"
            runs[kind].append(_one_build(tsv, out, tables, processes, cfg.part_bytes))
            logger.info("round %d/%d %s: %.0f rows/s", r + 1, cfg.repeats, kind,
                        runs[kind][-1]["rows_per_sec"])  # fmt: skip
    result: dict[str, Any] = {"parts": parts}
    for kind, processes in kinds.items():
        rates = [x["rows_per_sec"] for x in runs[kind]]
        result[kind] = {"processes": processes, "processes_used": min(processes, parts),
                        "rows_per_sec": statistics.median(rates), "runs": runs[kind]}  # fmt: skip
    result["speedup"] = result["parallel"]["rows_per_sec"] / result["single"]["rows_per_sec"]
    result["round_speedups"] = [  # each round's pair: the two ran back to back
        b["rows_per_sec"] / a["rows_per_sec"] for a, b in zip(*runs.values(), strict=True)
    ]
    result["differing_files"] = differing(cfg.work / "cache-single", cfg.work / "cache-parallel")
    result["identical"] = not result["differing_files"]
    return result


def differing(a: Path, b: Path) -> list[str]:
    """Files of folder ``a`` or ``b`` that are not byte-identical in the other."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}

    def same(n: str) -> bool:
        return (a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False)

    return sorted(n for n in names if not same(n))


def cache_figures(cache: Path) -> dict[str, Any]:
    """Bytes per row of a cache, from the sizes of its files (``.npy`` headers included)."""
    meta = json.loads((cache / "meta.json").read_text())
    rows = int(meta["rows"])
    files = {p.name: p.stat().st_size for p in sorted(cache.iterdir())}
    arrays = sum(n for name, n in files.items() if name.endswith(".npy"))
    return {
        "rows": rows, "files": files, "bytes": sum(files.values()),
        "bytes_per_row": arrays / rows,
        # what a cache of real Criteo data holds: no true probabilities
        "bytes_per_row_without_prob": (arrays - files.get("prob.npy", 0)) / rows,
        "dtypes": meta["dtypes"],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# training


def train_args(
    cfg: TrainScaleConfig, tsv: Path, run: Path, train_rows: int, batch: int
) -> list[str]:
    """``training.train``'s arguments: the preset on ``tsv``, ``windows + 1`` windows of
    ``window`` steps, evaluations on one batch, a checkpoint only at the end."""
    steps = cfg.window * (cfg.windows + 1)
    epochs = math.ceil(steps * batch / train_rows) + 1  # the data never runs out mid-window
    return [
        "--config", str(cfg.preset), "--run-dir", str(run), "--data", str(tsv), "--no-progress",
        "--resume", "none", f'data.cache_dir="{cfg.work / "cache"}"',
        f"data.eval_fraction={EVAL_FRACTION}", f"train.batch_size={batch}",
        f"train.max_steps={steps}", f"train.epochs={epochs}", f"train.eval_every={cfg.window}",
        f"train.eval_rows={batch}", "train.checkpoint_every=0",
        *cfg.train_overrides,
    ]  # fmt: skip


def topology(text: str) -> tuple[int, int]:
    """``"2x1"`` -> (2 nodes, 1 rank per node)."""
    nodes, _, ranks = text.partition("x")
    if not (nodes.isdigit() and ranks.isdigit() and int(nodes) >= 1 and int(ranks) >= 1):
        raise shared.ConfigError(f"topologies: {text!r} is not NODESxRANKS, e.g. 1x2 or 2x1")
    return int(nodes), int(ranks)


def launch_commands(nodes: int, ranks: int, args: list[str]) -> list[list[str]]:
    """One torchrun per node; several nodes meet at a c10d rendezvous on this machine, whose
    store the first one hosts (``is_host`` said, not guessed from the address: all match)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    if nodes == 1:
        return [
            [torchrun, "--standalone", f"--nproc_per_node={ranks}", "-m", "training.train", *args]
        ]
    port, rdzv = free_ports(1)[0], f"bench-scale-{os.getpid()}-{time.monotonic_ns()}"
    return [[torchrun, f"--nnodes={nodes}", f"--nproc_per_node={ranks}",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv}",
             f"--rdzv_conf=is_host={int(n == 0)}", "-m", "training.train", *args]
            for n in range(nodes)]  # fmt: skip


def run_together(cmds: list[list[str]], log: Path, timeout: float) -> dict[str, Any]:
    """Run ``cmds`` at once (output to ``log``.<i>); seconds and the peak RSS of any process
    they started. One failing, or the timeout, stops the others; raises RuntimeError then."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}  # 1 thread a rank
    paths = [log.with_suffix(f".{i}.log") for i in range(len(cmds))]
    t0, machine, procs = time.perf_counter(), machine_cpu_seconds(), []
    for cmd, path in zip(cmds, paths, strict=True):
        with path.open("w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
    codes: dict[int, int] = {}  # index -> exit code
    peak, cpu = 0, 0.0
    try:
        while len(codes) < len(procs):
            for i, p in enumerate(procs):
                pid, status, usage = (0, 0, None) if i in codes else os.wait4(p.pid, os.WNOHANG)
                if pid and usage:  # ru_maxrss: the largest of it and its descendants, in KiB
                    p.returncode = codes[i] = os.waitstatus_to_exitcode(status)
                    peak = max(peak, usage.ru_maxrss * 1024)
                    cpu += usage.ru_utime + usage.ru_stime
            failed = [i for i, code in codes.items() if code != 0]
            if failed or time.perf_counter() - t0 > timeout:
                why = f"exited {codes[failed[0]]}" if failed else f"ran past {timeout:.0f} s"
                lines = paths[failed[0] if failed else 0].read_text().splitlines()
                said = [x for x in lines if x.startswith("error: ")] or lines[-5:]  # training's own
                raise RuntimeError(f"training launch {why}: " + "\n".join(said)
                                   + f"\n(logs: {', '.join(map(str, paths))})")  # fmt: skip
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if i not in codes:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    others = max(0.0, machine_cpu_seconds() - machine - cpu)
    return {"seconds": time.perf_counter() - t0, "cpu_s": cpu, "others_cpu_s": others,
            "peak_rss": peak, "logs": [str(x) for x in paths]}  # fmt: skip


def train_stage(cfg: TrainScaleConfig, tsv: Path) -> dict[str, Any]:
    """Each topology's samples/s (median of the measured windows) and the ratios to the first."""
    preset = load_config(cfg.preset)
    batch = cfg.batch_size or preset.train.batch_size
    train_rows = cfg.rows - round(cfg.rows * EVAL_FRACTION)
    prepare(parse_args(train_args(cfg, tsv, cfg.work / "runs" / "prepare", train_rows, batch)))
    out: dict[str, Any] = {"batch_size": batch, "steps": cfg.window * (cfg.windows + 1)}
    for name in cfg.topologies:
        nodes, ranks = topology(name)
        run = cfg.work / "runs" / name
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        cmds = launch_commands(nodes, ranks, train_args(cfg, tsv, run, train_rows, batch))
        launched = run_together(cmds, run / "launch", cfg.timeout_s)
        records = sorted(read_metrics(run / "metrics.jsonl"), key=lambda r: r["step"])
        rates = [r["samples_per_sec"] for r in records]
        out[name] = {
            "nodes": nodes, "ranks_per_node": ranks, "world": nodes * ranks,
            "samples_per_sec": statistics.median(rates[1:]), "windows": rates[1:],
            "warmup_samples_per_sec": rates[0], "final_eval": records[-1], **launched,
        }  # fmt: skip
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # GBs at the Kaggle shape
        logger.info("%s: %.0f samples/s", name, out[name]["samples_per_sec"])
    first = cfg.topologies[0]
    out["ratios"] = {f"{n}/{first}": out[n]["samples_per_sec"] / out[first]["samples_per_sec"]
                     for n in cfg.topologies[1:]}  # fmt: skip
    return out


def run(cfg: TrainScaleConfig) -> dict[str, Any]:
    """The selected stages; the figures as one JSON-ready dict."""
    for name in cfg.topologies:
        topology(name)  # a bad one fails before any work
    tables = load_config(cfg.preset).model.rows()
    result: dict[str, Any] = {"setup": {
        "rows": cfg.rows, "preset": str(cfg.preset), "tables": tables, "stages": cfg.stages,
        "topologies": cfg.topologies, "repeats": cfg.repeats, "part_bytes": cfg.part_bytes,
        "window": cfg.window, "windows": cfg.windows, "cpus": cpu_cores(),
        "torch": torch.__version__, "load_before": os.getloadavg(),
    }}  # fmt: skip
    cfg.work.mkdir(parents=True, exist_ok=True)
    tsv = synthetic_tsv(cfg)
    if "preprocess" in cfg.stages:
        result["preprocess"] = preprocess_stage(cfg, tsv, tables)
        result["cache"] = cache_figures(cfg.work / "cache-parallel")
    if "train" in cfg.stages:
        result["train"] = train_stage(cfg, tsv)
    result["setup"]["load_after"] = os.getloadavg()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``make bench-scale``)."""
    logs.configure(fmt="%(message)s")
    for name in ("training.data", "training.data.prep"):  # our own line per run says it
        logging.getLogger(name).setLevel(logging.WARNING)
    doc = __doc__.replace("``", "").replace("**", "")
    raw = argparse.RawDescriptionHelpFormatter  # the docstring's list as written
    parser = shared.config_parser(TrainScaleConfig, "python -m training.bench.scale", doc,
                                  epilog=EPILOG, formatter_class=raw)  # fmt: skip
    try:
        cfg = shared.from_args(TrainScaleConfig, parser.parse_args(argv))
        result = run(cfg)
    except (shared.ConfigError, RecsysError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "scale-training.json").write_text(json.dumps(result, indent=2))
    plot(result, cfg.out / "scale-training.png")
    print(table(result))
    print(f"wrote {cfg.out / 'scale-training.json'} and {cfg.out / 'scale-training.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
