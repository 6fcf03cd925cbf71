"""``make bench-freshness``: end of a training pass -> every worker serving it, measured through
the continuous loop itself (issue 47), at each ``--presets`` shape.

Per preset: ``--passes`` + 4 synthetic days of ``--rows`` rows (ids drawn over the preset's own
table sizes, so a pass touches as many rows as traffic of that size would), drifting by
``--drift`` a day. The loop (``torchrun -m training.continuous``, ``continuous.deltas=true``,
a publish every file, ``--nproc`` processes: ``make continuous``) takes days 0 and 1 with no stack: the model after
day 0 is exported and becomes the served default. ``make serve``'s supervisor serves it
(``--replicas`` TorchServe replicas x ``--workers`` workers behind the gateway) under headless
Locust (the chaos run's user: one record per call) until the end. Then ``--passes`` + 1 days
arrive at once and the same loop command runs on: at each day it publishes the model before
it as a delta over the served default, gated on that day's rows, then trains on it. Each
delta's record in ``RUN/continuous.jsonl`` is the figure: ``freshness_s`` (the pass's end,
checkpoint written -> the last worker's acknowledgement, by the worker's clock) and its parts
(``since_pass_s``: loading and scoring the day the gate judges on; ``make_s``: the delta and
the gate's scoring; ``publish_s``: the publisher's judging, the pointer and every ack), rows,
bytes and the rows compared. The first delta's pass ended in the first loop process, before
the stack started: its clock is not the loop's, and the figures are the other ``--passes``.
Failed calls: Locust's calls that started during the loop and did not end OK.

**The changed-ids check**: then the checkpoint the last delta was made of is exported in full
(int8, ``python -m training.export --no-archive``) and a batch whose every id hits a row that
delta changed is scored by every replica (TorchServe's own gRPC API, each worker likely) and in
process by that full export: the largest |difference| is ``max_abs_diff``.

**The full path**: one more day with ``continuous.deltas=false``: its publish is the loop's
export + rollout (their ``seconds``, the ``.mar``'s bytes, the calls that failed meanwhile).
Writes ``--out``/freshness.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.chaos import LOCUSTFILE, Records
from loadtest.chaos_report import LOG_ENV
from loadtest.config import LoadConfig
from loadtest.locust_runner import locust_env

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PASS_ROWS = {"tiny": 20_000, "demo": 65_536, "criteo-kaggle": 196_608}  # 8 / 24 steps
TIMEOUT_S = {"tiny": 600, "demo": 1200, "criteo-kaggle": 3600}


def py(args: list[str], log: Path, env: dict[str, str] | None = None, tool: str = "") -> str:
    """``python -m args`` (or ``tool`` from the venv) -> stdout; raises naming the log."""
    cmd = [str(VENV_BIN / tool)] if tool else [sys.executable, "-m"]
    with log.open("a") as err:
        proc = subprocess.run([*cmd, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                              text=True, env={**os.environ, **(env or {})})  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{' '.join([*cmd, *args][:4])} exited {proc.returncode}: see {log}")
    return proc.stdout


def table_sizes(preset: str) -> list[int]:
    from training.config import load_config

    return [int(r) for r in load_config(ROOT / f"training/configs/{preset}.toml").model.rows()]


def loop_args(preset: str, work: Path, nproc: int, extra: Sequence[str]) -> list[str]:
    """torchrun's arguments for the continuous loop over ``work/inbox`` (``make continuous``
    with deltas, a publish every file), its run, caches, store and stack state under ``work``."""
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "training.continuous", "--config",
            f"training/configs/{preset}.toml", "--run-dir", str(work / "run"), "--data-dir",
            str(work / "inbox"), "--no-progress", "continuous.export_every=1",
            "continuous.deltas=true", "train.keep_last=3", f'data.cache_dir="{work / "cache"}"',
            f'continuous.model_store="{work / "store"}"', f'continuous.serve_dir="{work / "serve"}"',
            'continuous.export_args=["--parity-rows", "2000"]', *extra]  # fmt: skip


def loop(
    preset: str, work: Path, extra: list[str], log: Path, env: dict[str, str], nproc: int
) -> None:
    """The continuous loop over ``work/inbox`` until no file is left (:func:`loop_args`)."""
    py(loop_args(preset, work, nproc, extra), log,
       {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}, tool="torchrun")  # fmt: skip


def serve(
    schema: Path,
    replicas: int,
    workers: int,
    log: Path,
    env: dict[str, str],
    extra: Sequence[str] = (),
) -> int:
    """``make serve``'s supervisor on free ports (state and store in ``env``): ``replicas`` x
    ``workers`` behind the gateway; the gateway's port."""
    from recsys_stack.net import free_ports

    p = free_ports(7)
    names = ("inference", "management", "metrics", "grpc-inference", "grpc-management")
    py(["serving.tools.supervisor", "start", "--gateway.schema", str(schema), "--replicas",
        str(replicas), "--torchserve.workers", str(workers), "--gateway.port", str(p[5]),
        "--gateway.metrics.port", str(p[6]), "--timeout-s=600", *extra,
        *(x for k, v in zip(names, p[:5], strict=True) for x in (f"--torchserve.{k}-port", str(v)))],
       log, env)  # fmt: skip
    return p[5]


def move_days(days: Path, inbox: Path, names: list[str], flip: str = "") -> None:
    """``names`` into ``inbox`` whole (renamed in); ``flip``: that day with every label
    flipped (a poisoned file: the loop must quarantine it)."""
    inbox.mkdir(parents=True, exist_ok=True)
    for n in names:
        for suffix in (".tsv", ".prob.npy"):
            part = inbox / f"{n}{suffix}.part"
            if n == flip and suffix == ".tsv":
                with (days / f"{n}.tsv").open() as src, part.open("w") as dst:
                    dst.writelines(("0" if r[0] == "1" else "1") + r[1:] for r in src)
            else:
                shutil.copy(days / f"{n}{suffix}", part)
            os.replace(part, inbox / f"{n}{suffix}")


def start_locust(
    target: str, data: Path, users: int, out: Path, stack: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Headless Locust (the chaos user: a record per call in ``out/requests``) until stopped;
    ``stack``: the stack's state folder (its gateway token) in ``RECSYS_SERVE_DIR``."""
    (out / "requests").mkdir(parents=True, exist_ok=True)
    cfg = LoadConfig(host=target, users=users, spawn_rate=float(users), data=data, examples=100)
    env = {**locust_env(cfg, target), **stack, LOG_ENV: str(out / "requests")}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", target,
           "-u", str(users), "-r", str(users), "-t", "24h", "--only-summary",
           "--stop-timeout", "2", "--exit-code-on-error", "0", "--loglevel", "WARNING"]  # fmt: skip
    with (out / "locust.log").open("a") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)


def one(preset: str, a: argparse.Namespace) -> dict[str, Any]:
    work, out = a.work / preset, a.out / preset
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    log, rows = work / "bench.log", a.rows or PASS_ROWS[preset]
    sizes = table_sizes(preset)
    py(["training.data.synthetic", "--days", str(a.passes + 4), "--rows", str(rows), "--drift",
        str(a.drift), "--vocab", *map(str, sizes), "--out", str(work / "days"), "--no-progress"],
       log)  # fmt: skip
    move_days(work / "days", work / "inbox", ["day_0", "day_1"])
    loop(preset, work, ["continuous.rollout=false"], log, {}, a.nproc)
    schema = work / "run" / "export" / "schema.json"
    env = {"RECSYS_SERVE_DIR": str(work / "serve"), "RECSYS_MODEL_STORE": str(work / "store")}
    port = serve(schema, a.replicas, a.workers, log, env)
    result: dict[str, Any] = {"preset": preset, "rows_per_pass": rows, "tables_rows": sum(sizes),
                              "replicas": a.replicas, "workers": a.workers, "nproc": a.nproc,
                              "users": a.users}  # fmt: skip
    locust = None
    try:
        (out / "requests").mkdir(parents=True, exist_ok=True)
        records = Records(out / "requests")
        if a.users:  # 0: no load (the loop's figure on a machine it has to itself)
            locust = start_locust(f"127.0.0.1:{port}", work / "days" / "day_0.tsv", a.users, out,
                                  env)  # fmt: skip
            end = time.monotonic() + 120
            while not records.poll() and time.monotonic() < end:
                time.sleep(0.5)
        t0 = time.time()
        flip = f"day_{a.flip_day}" if a.flip_day is not None else ""
        move_days(work / "days", work / "inbox", [f"day_{d}" for d in range(2, a.passes + 3)], flip)
        loop(preset, work, [], log, env, a.nproc)
        t1 = time.time()
        calls = [c for c in records.poll() if t0 <= c.start <= t1]
        result["calls"], result["failed"] = len(calls), sum(c.code != "OK" for c in calls)
        events = [json.loads(x) for x in (work / "run" / "continuous.jsonl").open()]
        result.update(phase(events))
        result["quarantined"] = [{k: e.get(k) for k in ("file", "reason", "step")}
                                 for e in events if e["event"] == "quarantined"]  # fmt: skip
        result["max_abs_diff"], result["checked_rows"] = changed_ids_check(work, env, log)
        t2 = time.time()  # the full path: one more day with deltas off (export + rollout)
        move_days(work / "days", work / "inbox", [f"day_{a.passes + 3}"])
        loop(preset, work, ["continuous.deltas=false"], log, env, a.nproc)
        calls = [c for c in records.poll() if t2 <= c.start <= time.time()]
        events = [json.loads(x) for x in (work / "run" / "continuous.jsonl").open()]
        full = {e["event"]: e for e in events if e["event"] in ("export", "rollout")}  # the last
        result["full"] = {"export_s": full["export"].get("seconds"),
                          "rollout_s": full["rollout"].get("seconds"),
                          "promoted": full["rollout"].get("promoted"),
                          "mar_bytes": Path(full["export"]["mar"]).stat().st_size,
                          "calls": len(calls), "failed": sum(c.code != "OK" for c in calls)}  # fmt: skip
    finally:
        if locust is not None:
            locust.send_signal(signal.SIGINT)
            locust.wait(30)
        py(["serving.tools.supervisor", "stop"], log, env)
    # the first delta's pass ended in the previous loop process, before the stack started: its
    # clock is not the loop's (since_pass_s 0); the figures are those of the others
    fresh = [d["freshness_s"] for d in result["deltas"][1:] if d["promoted"]]
    result["freshness_p50_s"] = round(statistics.median(fresh), 2) if fresh else None
    result["freshness_max_s"] = max(fresh) if fresh else None
    return result


DELTA_KEYS = ("version", "promoted", "freshness_s", "since_pass_s", "early", "make_s", "delta_s",
              "diff_s", "publish_s", "found_s", "judged_s", "served_s", "rows", "compared",
              "bytes", "workers", "reason", "fallback")  # fmt: skip


def phase(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta phase's figures from ``RUN/continuous.jsonl``: each delta's record, and each
    compaction's (every ``continuous.compact_every`` deltas the publish is an export +
    rollout: its ``freshness_s`` is the pass's end -> the rollout command's end)."""
    after = [e for e in events if e["event"] == "delta"][:1]
    start = events.index(after[0]) if after else len(events)
    return {"deltas": [{k: e.get(k) for k in DELTA_KEYS} for e in events if e["event"] == "delta"],
            "compactions": [{"version": e.get("version"), "promoted": e.get("promoted"),
                             "freshness_s": e.get("freshness_s"), "rollout_s": e.get("seconds")}
                            for e in events[start:] if e["event"] == "rollout"]}  # fmt: skip


def changed_ids_check(work: Path, env: dict[str, str], log: Path) -> tuple[float, int]:
    """Module doc: every replica's scores against the full export of the last delta's
    checkpoint, on ids that delta changed."""
    import grpc
    import torch

    from recsys_model.delta import read_pointer
    from recsys_model.mapped import layout, load_mapped
    from serving.tools.served import Stack
    from serving.torchserve.client import inference_key, score
    from serving.worker.codec import decode_response, encode_request

    schema = json.loads((work / "run" / "export" / "schema.json").read_text())
    model, version = schema["model"]["name"], str(schema["model"]["version"])
    folder = (work / "store").resolve() / "deltas" / model / version
    last = read_pointer(folder)["chain"][-1]
    delta = torch.load(folder / last["file"], weights_only=True)
    full = work / "run" / "export"  # the loop is done: its export folder is free
    py(["training.export", "--run-dir", str(work / "run"), "--checkpoint", delta["checkpoint"],
        "--model-store", str(work / "full-store"), "--version", "check", "--formats", '["int8"]',
        "--parity-rows", "2000", "--no-progress", "--no-archive"], log)  # fmt: skip
    scorer = load_mapped(full / "mapped_int8.pt", torch.device("cpu"))
    sizes = [int(r) for r in scorer.spec["rows"]]
    local, _, _ = layout(sizes, scorer.dim, ["int8"] * len(sizes))
    ids = delta["ids"].numpy()
    rng, b = np.random.default_rng(0), 256
    values = []
    for t, n in enumerate(sizes):  # each feature's id: a row this delta changed in its table
        mine = ids[(ids >= local[t]) & (ids < local[t] + n)] - local[t]
        values.append(rng.choice(mine, b) if len(mine) else rng.integers(0, n, b))
    dense = rng.normal(size=(b, int(scorer.spec["num_dense"]))).astype(np.float32)
    batch = (dense, np.concatenate(values), np.ones((len(sizes), b), np.int32))
    with torch.inference_mode():
        want = scorer(*(torch.from_numpy(x) for x in batch)).numpy()
    from serving.gateway.config import ChannelConfig

    stack = Stack.find(ChannelConfig(), Path(env["RECSYS_SERVE_DIR"]))
    worst, body = 0.0, encode_request(*batch)
    for ts in stack.replicas:
        with grpc.insecure_channel(ts.grpc_inference_target) as ch:
            for _ in range(8):  # each worker, likely
                got = decode_response(
                    score(ch, (model, version), body, 30, inference_key(ts.key_file))
                )
                worst = max(worst, float(np.abs(got - want).max()))
    return worst, b


def table(results: list[dict[str, Any]]) -> str:
    head = ("| shape | pass rows | deltas promoted | freshness p50 / max s | since pass / make / "
            "served s (p50) | rows (p50) | bytes (p50) | compared (p50) | failed calls | "
            "max abs diff (changed ids) |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]  # deltas: the second on (see one())
    for r in results:
        ok = [d for d in r["deltas"][1:] if d["promoted"]]

        def med(k: str, ds: list[dict[str, Any]] = ok) -> Any:
            xs = [d[k] for d in ds if isinstance(d.get(k), int | float)]
            return round(statistics.median(xs), 2) if xs else "-"

        lines.append(f"| {r['preset']} | {r['rows_per_pass']:,} | {len(ok)} of {len(r['deltas']) - 1} | "
                     f"{r['freshness_p50_s']} / {r['freshness_max_s']} | {med('since_pass_s')} / "
                     f"{med('make_s')} / {med('served_s')} | {med('rows'):,.0f} | {med('bytes'):,.0f} | "
                     f"{med('compared'):,.0f} | {r['failed']} of {r['calls']:,} | "
                     f"{r['max_abs_diff']:.2g} ({r['checked_rows']} rows) |")  # fmt: skip
        for c in r.get("compactions", []):
            lines.append(f"| {r['preset']}, compaction (export + rollout) | {r['rows_per_pass']:,} | "
                         f"{'1 of 1' if c['promoted'] else '0 of 1'} | {c['freshness_s']} | "
                         f"rollout {c['rollout_s']} | all | - | all | (in the deltas' row) | - |")  # fmt: skip
        f = r["full"]
        lines.append(f"| {r['preset']}, full publish (deltas off) | {r['rows_per_pass']:,} | "
                     f"{'1 of 1' if f['promoted'] else '0 of 1'} | - | export {f['export_s']} + "
                     f"rollout {f['rollout_s']} | all | {f['mar_bytes']:,} (.mar) | all | "
                     f"{f['failed']} of {f['calls']:,} | - |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.freshness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--presets", nargs="+", default=["demo", "criteo-kaggle"])
    p.add_argument("--passes", type=int, default=5, help="deltas measured (one a pass; one more "
                   "is made first, its clock started before the stack)")  # fmt: skip
    p.add_argument("--rows", type=int, default=0, help="rows a day (0: 24 steps of the preset)")
    p.add_argument("--drift", type=float, default=0.05)
    p.add_argument("--users", type=int, default=4, help="Locust users (0: no load)")
    p.add_argument("--nproc", type=int, default=2, help="the loop's processes (make's NPROC)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="TorchServe workers a replica")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-freshness"))
    p.add_argument("--out", type=Path, default=Path("reports/bench-freshness"))
    p.add_argument("--flip-day", type=int, help="that day (>= 3) arrives with its labels "
                   "flipped: the quarantine's acceptance (it is not trained, no delta is judged on "
                   "it, later days are published)")  # fmt: skip
    p.add_argument("--table", type=Path, help="print the table of this freshness.json, run nothing")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(a.table.read_text())))
        return 0
    results = []
    for preset in a.presets:
        results.append(one(preset, a))
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "freshness.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
