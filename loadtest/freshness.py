"""``make bench-freshness``: end of a training pass -> every replica serving it, by delta and by
full re-export, side by side in one run, at each ``--presets`` shape (issue 36).

Per preset: train ``--steps`` steps (synthetic rows, one process), export version 1 and serve
it on 2 TorchServe replicas x 2 workers behind the gateway (``loadtest.chaos``' cluster) under
headless Locust (the chaos user: one record per call). Then train one more pass of ``--steps``
steps; its end (the process exits with the checkpoint written) starts both clocks:

* **delta**: ``training.export.delta`` (the rows whose int8 bytes changed + dense; in a
  process started before the pass, with torch imported, as the continuous loop makes it),
  gated as the loop gates it: the candidate and what serves scored on rows neither trained
  on (the last tenth of the data, inside the eval split), a lower AUC refuses it
  and ``serving.tools.deltas``' move (pointer renamed in, every worker of both replicas
  acknowledges). ``freshness_s``: end of pass -> the last acknowledgement;
* **full**: ``python -m training.export`` of the same checkpoint as version 2 (``.mar``) and
  its registration on both replicas until READY (TorchServe unpacks the archive at each).
  ``freshness_s``: end of pass -> READY everywhere (the gateway's plan switch, ~1 s, not
  included: the full path is measured to its cheapest end).

Between the two, the delta is rolled back under the same load (the pointer back one delta;
``served_s``: every worker serving N again) and moved forward again.

Failed calls are the Locust calls of each window that did not end OK. ``max_abs_diff``: the
replicas' replies after the delta against the full export of the same checkpoint scored in
process. Writes ``--out``/freshness.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.chaos import LOCUSTFILE, ChaosConfig, Records, start_cluster
from loadtest.chaos_report import LOG_ENV
from loadtest.config import LoadConfig
from loadtest.faults import stop_all
from loadtest.locust_runner import run_locust
from serving.gateway.config import GatewayConfig
from serving.tools.deltas import judge, move
from serving.torchserve import manage
from serving.torchserve.client import inference_key, score
from serving.worker.codec import decode_response, encode_request

ROOT = Path(__file__).resolve().parents[1]
# The delta maker with torch and the export imported, as in the continuous loop's own process
# (which makes the delta after its pass): it reads its argv as one JSON line, then runs.
WARM = ("import json, sys; import training.export.delta as d; "
        "import training.checkpoint.store, training.config; "
        "sys.exit(d.main(json.loads(sys.stdin.readline())))")  # fmt: skip
LOAD_S = {"tiny": 150, "demo": 200, "criteo-kaggle": 600}  # Locust's run, spanning both paths


def py(args: list[str], log: Path) -> tuple[float, str]:
    """``python -m args`` -> (seconds, stdout); raises naming the log on failure."""
    t0 = time.perf_counter()
    with log.open("a") as err:
        proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=err, text=True)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"python -m {' '.join(args[:1])} exited {proc.returncode}: see {log}")
    return time.perf_counter() - t0, proc.stdout


def train(preset: str, run: Path, work: Path, steps: int, first: bool) -> float:
    data = [f'data.cache_dir="{work / "cache"}"', f'data.synthetic_dir="{work / "syn"}"',
            "data.synthetic_rows=60000", "train.batch_size=1024"]  # fmt: skip
    return py(["training.train", "--config", f"training/configs/{preset}.toml", "--run-dir",
               str(run), "--no-progress", "--resume", "none" if first else "auto",
               f"train.max_steps={steps}", *data], work / "train.log")[0]  # fmt: skip


def export(run: Path, store: Path, version: str, work: Path) -> float:
    return py(["training.export", "--run-dir", str(run), "--no-progress", "--model-store",
               str(store), "--version", version, "--parity-rows", "2000", "--overwrite"],
              work / "export.log")[0]  # fmt: skip


def unseen_rows(data: Path, run: Path, out: Path) -> Path:
    """The last tenth of ``data``'s rows (inside the eval split the runs never train on) as
    ``out``, parsed into the run's cache now: the loop's gate reads the arriving file that its
    progressive validation parsed before the pass (training/continuous/deltas.py)."""
    from training.checkpoint import store as checkpoint
    from training.config import config_from_dict
    from training.export.delta import unseen_arrays

    lines = data.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[-(len(lines) // 10) :]))
    ckpt = checkpoint.read_latest(run / "checkpoints")
    assert ckpt is not None, run
    unseen_arrays(out, config_from_dict(checkpoint.read_meta(ckpt)["config"]), 0)
    return out


def failed(records: Records, t0: float, t1: float) -> tuple[int, int]:
    """(calls, failed calls) of Locust's records that started in [t0, t1]."""
    calls = [c for c in records.poll() if t0 <= c.start <= t1]
    return len(calls), sum(c.code != "OK" for c in calls)


def replies(cluster: Any, body: bytes, model: tuple[str, str]) -> list[np.ndarray]:
    import grpc

    out = []
    for r in cluster.replicas:
        with grpc.insecure_channel(r.cfg.grpc_inference_target) as ch:
            for _ in range(4):  # each worker, likely
                got = score(ch, model, body, 30, inference_key(r.cfg.key_file))
                out.append(decode_response(got))
    return out


def one(preset: str, a: argparse.Namespace) -> dict[str, Any]:
    work = a.work / preset
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run, store, base = work / "run", work / "store", work / "base"
    train(preset, run, work, a.steps, first=True)
    export(run, store, "1", work)
    shutil.copytree(run / "export", base)
    schema = json.loads((base / "schema.json").read_text())
    model = schema["model"]["name"]
    data = next((work / "syn").glob("*.tsv"))
    gate = unseen_rows(data, run, work / "gate.tsv")
    cfg = ChaosConfig(model_store=store, workers=2, data=data, users=a.users,
                      gateway=GatewayConfig(schema=base / "schema.json"))  # fmt: skip
    out = a.out / preset
    (out / "requests").mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(cfg, out)
    result: dict[str, Any] = {"preset": preset}
    try:
        load = LoadConfig(host=cluster.target, users=a.users, spawn_rate=float(a.users),
                          duration=f"{LOAD_S[preset]}s", data=data, examples=100)  # fmt: skip
        locust = threading.Thread(target=run_locust, daemon=True, args=(
            load, cluster.target, a.users, load.duration, out / "locust", float(a.users)),
            kwargs={"locustfile": LOCUSTFILE, "env": {LOG_ENV: str(out / "requests")}})  # fmt: skip
        locust.start()
        records = Records(out / "requests")
        while not records.poll():
            time.sleep(0.2)
        with (work / "delta.log").open("a") as log:
            maker = subprocess.Popen([sys.executable, "-c", WARM], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        result["train_pass_s"] = round(train(preset, run, work, 2 * a.steps, first=False), 1)
        t_end = time.time()
        folder = store.resolve() / "deltas" / model / "1"
        args = ["--run-dir", str(run), "--base", str(base), "--deltas", str(folder),
                "--version", str(2 * a.steps), "--unseen-data", str(gate), "--eval-rows", "0"]  # fmt: skip
        assert maker.stdin is not None and maker.stdout is not None
        maker.stdin.write(json.dumps(args) + "\n")
        maker.stdin.flush()
        printed = maker.stdout.readline()  # its record, printed before the process ends
        made = time.time()
        if not printed:
            raise RuntimeError(f"training.export.delta exited {maker.wait(900)}: see {work}")
        record = json.loads(printed)
        record["gate"] = judge(Path(record["gate"]["judge"]), [])  # the rollout's rules
        if not record["gate"]["passed"]:
            raise RuntimeError(f"the evaluated gate refused the delta: {record['gate']}")
        entry = {k: v for k, v in record.items() if k != "gate"}
        maker.wait(timeout=900)
        pids = [int(w["pid"]) for r in cluster.replicas
                for m in manage.describe(r.cfg, model, "1") or [] for w in m["workers"]]  # fmt: skip
        moved = move(folder, lambda _: [entry], pids, 120)
        t_served = time.time()
        calls, bad = failed(records, t_end, t_served)
        result["delta"] = {"rows": record["rows"], "bytes": record["bytes"],
                           "row_bytes": record["row_bytes"],
                           "dense_bytes": record["dense_bytes"], "make_s": round(made - t_end, 2),
                           "inside_s": record["seconds"], "served_s": moved["served_s"],
                           "freshness_s": round(t_served - t_end, 2), "calls": calls,
                           "failed": bad, "workers": len(pids), "gate": record["gate"]}  # fmt: skip
        rng = np.random.default_rng(0)
        feats = len(schema["features"]["sparse"])
        b = 256
        batch = (rng.normal(size=(b, len(schema["features"]["dense"]))).astype(np.float32),
                 rng.integers(0, 10**7, feats * b), np.ones((feats, b), np.int32))  # fmt: skip
        after = replies(cluster, encode_request(*batch), (model, "1"))
        t_back = time.time()  # rollback to N under the same load: the pointer back one delta
        back = move(folder, lambda _: [], pids, 120)
        calls, bad = failed(records, t_back, time.time())
        result["rollback"] = {"served_s": back["served_s"], "calls": calls, "failed": bad}
        move(folder, lambda _: [entry], pids, 120)  # forward again: the full path starts at N+1
        t_full = time.time()
        export_s = export(run, store, "2", work)
        for r in cluster.replicas:
            manage.register(r.cfg, model, "2", f"{model}-2.mar", 600)
        for r in cluster.replicas:
            manage.wait_ready(r.cfg, model, "2", 600)
        t_ready = time.time()
        calls, bad = failed(records, t_full, t_ready)
        result["full"] = {"export_s": round(export_s, 1), "register_s": round(t_ready - t_full - export_s, 1),
                          "bytes": (store / f"{model}-2.mar").stat().st_size,
                          "freshness_s": round(t_ready - t_full, 1), "calls": calls, "failed": bad}  # fmt: skip
        result["max_abs_diff"] = max_diff(run / "export", batch, after)
        locust.join()
        result["load_calls"], result["load_failed"] = failed(records, 0, time.time())
    finally:
        stop_all(cluster)
    return result


def max_diff(export_dir: Path, batch: tuple[np.ndarray, ...], after: list[np.ndarray]) -> float:
    """Largest |reply - the full export's in-process score| over the replies."""
    import torch

    from recsys_model.mapped import load_mapped

    full = load_mapped(export_dir / "mapped_int8.pt", torch.device("cpu"))
    with torch.inference_mode():
        want = full(*(torch.from_numpy(x) for x in batch)).numpy()
    return float(max(np.abs(got - want).max() for got in after))


def table(results: list[dict[str, Any]]) -> str:
    head = "| shape | path | rows | bytes | freshness_s | failed calls | max abs diff |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        d, f, b = r["delta"], r["full"], r["rollback"]
        floor = d["rows"] * d["row_bytes"] + d["dense_bytes"]  # rows x row bytes + dense
        lines.append(f"| {r['preset']} | delta | {d['rows']:,} | {d['bytes']:,} "
                     f"({d['bytes'] / floor:.2f}x rows x row bytes + dense) | "
                     f"{d['freshness_s']} (make {d['make_s']}, serve {d['served_s']}) | "
                     f"{d['failed']} of {d['calls']} | {r['max_abs_diff']:.2g} |")  # fmt: skip
        lines.append(f"| {r['preset']} | rollback to N | - | - | {b['served_s']} (serve) | "
                     f"{b['failed']} of {b['calls']} | - |")  # fmt: skip
        lines.append(f"| {r['preset']} | full re-export | all | {f['bytes']:,} (.mar) | "
                     f"{f['freshness_s']} (export {f['export_s']}, register {f['register_s']}) | "
                     f"{f['failed']} of {f['calls']} | - |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.freshness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--presets", nargs="+", default=["demo", "criteo-kaggle"])
    p.add_argument("--steps", type=int, default=20, help="steps of each training pass")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-freshness"))
    p.add_argument("--out", type=Path, default=Path("reports/bench-freshness"))
    a = p.parse_args(argv)
    results = []
    for preset in a.presets:
        results.append(one(preset, a))
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "freshness.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
