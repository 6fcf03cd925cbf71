"""``make bench-ready``: seconds from a replica's start to its first answered call, quiet and
beside a CPU hog, and where they go.

For each model store (``--store LABEL=DIR``, the newest archive in it; ``--kaggle DIR``: the
criteo-kaggle shape, all 33.8M table rows, trained 3 steps and exported into DIR once, then
reused), ``--runs`` starts quiet, then as many beside ``--hog`` busy processes (one run, side by
side). Each start is TorchServe as a replica runs it (``serving.torchserve.process``, the
entry's config, ``--workers``, 0 = the CPUs this process may use), in a fresh work folder, its
phases stamped as TorchServe's log shows them (polled every 20 ms):

- ``java``: the launcher and the JVM up (``Model server started.``);
- ``worker``: the archive extracted, a Python worker spawned and its imports (torch) done
  (``Torch worker started.``);
- ``handler``: the handler loaded (``recsys handler: ...``; it says how much of that was the
  artifact and tables' load and how much the warm-up);
- ``ready``: the management API says READY; ``first``: a one-example ``Predictions`` call
  answered (what a gateway's probe asks before it sends calls).

The model's files are in the page cache after the first start (a restarted container on the
same node sees the same). Writes ``--out``/ready.json and ready.png (stacked phases).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from serving.gateway.replica import probe_body
from serving.torchserve import process
from serving.torchserve.client import inference_key, score
from serving.torchserve.config import TorchServeConfig, on_free_ports, resolve_model

MARKERS = {
    "java": "Model server started.",
    "worker": "Torch worker started.",
    "handler": "recsys handler:",
}
PHASES = ("java", "worker", "handler", "ready", "first")
HANDLER = re.compile(r"loaded in ([\d.]+) s, warmed up in ([\d.]+) s")


class LogStamps:
    """Follows ``path`` from a thread: the monotonic time each marker first appeared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at: dict[str, float] = {}
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset, rest = 0, b""
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
                *whole, rest = (rest + chunk).split(b"\n")
                now = time.monotonic()
                for raw in whole:
                    line = raw.decode(errors="replace")
                    for name, marker in MARKERS.items():
                        if name not in self.at and marker in line:
                            self.at[name] = now
                            self.lines.append(line)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def hog(processes: int) -> Iterator[None]:
    """``processes`` busy Python loops (a 2-process hog takes both cores of a 2-core machine
    from everything at the same priority) for the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def first_answer(cfg: TorchServeConfig, dense: int, sparse: int, timeout: float) -> None:
    """Until a one-example call is answered (a worker READY may still refuse for a moment)."""
    body, deadline = probe_body(dense, sparse), time.monotonic() + timeout
    key = inference_key(cfg.key_file)
    with grpc.insecure_channel(cfg.grpc_inference_target) as channel:
        while True:
            try:
                score(channel, (cfg.model_name, cfg.model_version), body, 10.0, key)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def one_start(store: Path, work: Path, workers: int, shape: tuple[int, int]) -> dict[str, Any]:
    """Start a replica on ``store`` in a fresh ``work`` folder until its first answered call;
    the seconds from the start to each phase, and the handler's own split."""
    shutil.rmtree(work, ignore_errors=True)
    cfg = resolve_model(
        on_free_ports(TorchServeConfig(model_store=store, workdir=work, workers=workers))
    )
    stamps = LogStamps(cfg.log_file)
    t0 = time.monotonic()
    proc = process.start(cfg)
    try:
        process.wait_ready(cfg, 600, proc)
        ready = time.monotonic()
        first_answer(cfg, *shape, timeout=300)
        first = time.monotonic()
        time.sleep(0.1)  # the last marker's poll
    finally:
        stamps.stop()
        process.stop(proc)
    out = {k: stamps.at[k] - t0 for k in MARKERS if k in stamps.at}
    out.update(ready=ready - t0, first=first - t0)
    if m := next((HANDLER.search(x) for x in stamps.lines if HANDLER.search(x)), None):
        out.update(load=float(m[1]), warm_up=float(m[2]))
    return out


def schema_shape(store: Path) -> tuple[int, int]:
    """(dense, sparse) feature counts of the newest archive's schema."""
    mar = max(store.glob("*.mar"), key=lambda p: p.stat().st_mtime)
    with zipfile.ZipFile(mar) as z:
        schema = json.loads(z.read("schema.json"))
    return len(schema["features"]["dense"]), len(schema["features"]["sparse"])


def kaggle_store(work: Path) -> Path:
    """The criteo-kaggle shape (full tables) trained 3 steps and exported, built once."""
    store = work / "store"
    if not any(store.glob("*.mar")):
        from serving.bench.model import build_model

        print(f"building the criteo-kaggle shape into {work} (once; minutes)", flush=True)
        _, store = build_model(work, max_rows=10**9)
    return store


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in (*PHASES, "load", "warm_up") if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{label}, {cond}", s) for label, r in results.items() for cond, s in r.items()
            if cond in ("quiet", "hog")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.2))
    for i, (_, s) in enumerate(rows):
        left = 0.0
        for phase in PHASES:
            if phase in s:
                ax.barh(i, s[phase] - left, left=left, label=phase if i == 0 else None,
                        color=f"C{PHASES.index(phase)}")  # fmt: skip
                left = s[phase]
        ax.text(left, i, f" {left:.1f} s", va="center")
    ax.set_yticks(range(len(rows)), [n for n, _ in rows])
    ax.set_xlabel("seconds from start (median)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("replica start to first answered call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.ready", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--store", action="append", default=[], metavar="LABEL=DIR",
                    help="a model store to start on (its newest .mar); repeatable")  # fmt: skip
    ap.add_argument("--kaggle", type=Path, metavar="DIR",
                    help="build (once) and start the full criteo-kaggle shape, in DIR")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3, help="starts per condition (median shown)")
    ap.add_argument("--hog", type=int, default=2, help="busy processes beside the hog runs")
    ap.add_argument("--workers", type=int, default=0, help="workers; 0: this process's CPUs")
    ap.add_argument("--out", type=Path, default=Path("reports/bench-ready"))
    args = ap.parse_args(argv)
    stores = dict(s.split("=", 1) for s in args.store)
    if args.kaggle:
        stores["criteo-kaggle"] = str(kaggle_store(args.kaggle))
    if not stores:
        ap.error("name a model store (--store demo=model_store) or --kaggle DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    load = os.getloadavg()[0]
    for label, store in stores.items():
        shape = schema_shape(Path(store))
        results[label] = {}
        for cond, hogs in (("quiet", 0), ("hog", args.hog)):
            runs = []
            with hog(hogs):
                for i in range(args.runs):
                    r = one_start(Path(store), args.out / "work" / f"{label}-{cond}-{i}",
                                  args.workers, shape)  # fmt: skip
                    print(f"{label} {cond} #{i + 1}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)  # fmt: skip
                    runs.append(r)
            results[label][cond] = summary(runs)
            results[label][f"{cond}_runs"] = runs
    shutil.rmtree(args.out / "work", ignore_errors=True)
    results["load_average_at_start"] = load
    (args.out / "ready.json").write_text(json.dumps(results, indent=1))
    plot({k: v for k, v in results.items() if isinstance(v, dict)}, args.out / "ready.png")
    print(f"\n| model | condition | {' | '.join(PHASES)} | load | warm-up |")
    print("|---|---|" + "---|" * (len(PHASES) + 2))
    for label, r in results.items():
        if isinstance(r, dict):
            for cond in ("quiet", "hog"):
                s = r[cond]
                cells = [f"{s[k]:.1f}" if k in s else "-" for k in (*PHASES, "load", "warm_up")]
                print(f"| {label} | {cond} | {' | '.join(cells)} |")
    print(f"load average at the start: {load:.2f}; {args.out / 'ready.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
