"""Several versions and rollouts on the real stack: ``make serve`` with two TorchServe replicas,
``python -m serving.tools.rollout`` under a running Locust load, Triton's client routing versions.

Three archives of one model: v1 (the tiny run's step-30 checkpoint), v2 (its step 40) and v3, a
candidate worse on purpose (two training steps). v1 -> v2 is promoted (v1 kept loaded for its
grace), v3 is refused, a replica restarted after the promotion loads the plan's v2 and kept v1
(not the archive it first started with), ``--rollback`` returns to v1 with a plan switch (v1's
workers are the ones loaded before: nothing registered again), and ``make rollout`` after the
grace unregisters v2; Locust's calls all succeed meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from loadtest import report
from serving import plan as plan_io
from serving.gateway.auth import client_token
from serving.tools import canary, evaluate
from serving.tools.supervisor import read_state, replicas
from serving.torchserve import manage, process
from tests.conftest import EXPORT_TINY, ROOT, _env, run_export, run_train
from tests.stack import STARTUP_TIMEOUT_S, run_python, start_supervisor

MODEL = "dlrm-tiny"


@pytest.fixture(scope="module")
def versions(
    trained: Path, data_dirs: list[str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path], Path]:
    """(model store, {version: export folder}, the labelled TSV the runs trained on)."""
    base = tmp_path_factory.mktemp("ro")
    run = base / "run"  # a copy: exporting writes <run>/export, which other tests read
    shutil.copytree(trained / "checkpoints", run / "checkpoints")
    shutil.copy(trained / "config.json", run / "config.json")
    store = base / "store"
    exports: dict[str, Path] = {}
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert len(steps) >= 2, steps
    for version, ckpt in (("1", steps[0]), ("2", steps[-1])):
        run_export(["--checkpoint", str(ckpt), "--version", version, "--model-store", str(store)])
        exports[version] = shutil.copytree(run / "export", base / f"export-{version}")
    bad = base / "bad"  # worse on purpose: two steps of training
    run_train([*EXPORT_TINY, "--run-dir", str(bad), *data_dirs, "train.max_steps=2"], nproc=0)
    # another run, the same model on purpose (a name given is the user's to share)
    run_export(["--run-dir", str(bad), "--name", MODEL, "--version", "3",
                "--model-store", str(store)])  # fmt: skip
    exports["3"] = bad / "export"
    synthetic = Path(data_dirs[1].split("=", 1)[1].strip('"'))
    return store, exports, next(synthetic.glob("*.tsv"))


@contextlib.contextmanager
def locust(target: str, data: Path, out: Path, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Locust (4 users, 100 examples per call) for the block; the dict gets its summary."""
    out.mkdir(parents=True, exist_ok=True)
    lenv = dict(env, RECSYS_GATEWAY=target, LOADTEST_DATA=str(data), LOADTEST_EXAMPLES="100",
                LOADTEST_TIMEOUT_S="5")  # fmt: skip
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
           "--headless", "--host", target, "-u", "4", "-r", "4", "-t", "900s",
           "--csv", str(out / "locust"), "--only-summary", "--stop-timeout", "2"]  # fmt: skip
    with (out / "locust.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=lenv, stdout=log, stderr=subprocess.STDOUT)
    summary: dict[str, Any] = {}
    try:
        yield summary
    finally:
        proc.send_signal(signal.SIGTERM)  # Locust stops its users and writes its CSVs
        proc.wait(timeout=60)
    summary.update(report.summarize(out / "locust"))
    print("locust:", {k: summary[k] for k in ("requests", "failures", "failures_by_type")})


def _scores(target: str, token: str, rows: dict[str, np.ndarray], version: str = "") -> tuple[np.ndarray, str]:  # fmt: skip
    """The sample rows through the gateway's KServe v2 service with Triton's own client."""
    inputs = []
    for name, datatype in (("dense", "FP32"), ("values", "INT64"), ("lengths", "INT32")):
        t = triton.InferInput(name, list(rows[name].shape), datatype)
        t.set_data_from_numpy(rows[name])
        inputs.append(t)
    with triton.InferenceServerClient(target) as client:
        result = client.infer(MODEL, inputs, model_version=version,
                              headers={"authorization": f"Bearer {token}"}, client_timeout=30)  # fmt: skip
        return result.as_numpy("scores"), result.get_response().model_version


def _expected(export: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    s = np.load(export / "sample.npz")
    variant = json.loads((export / "schema.json").read_text())["served_variant"]
    return {k: s[k] for k in ("dense", "values", "lengths")}, s[f"probs_{variant}"]


def _metric(target_metrics: str, name: str, label: str = "model_version") -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{target_metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels.get(label, ""): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def _wait_calls(metrics_at: str, n: int, timeout: float = 180.0) -> None:
    """Until the gateway has answered ``n`` more calls: Locust's users are up and calling."""

    def calls() -> float:
        text = canary.scrape(f"http://{metrics_at}/metrics") or ""
        return sum(total for total, _ in canary.outcomes(text).values())

    t0, base = time.monotonic(), calls()
    while calls() - base < n:
        assert time.monotonic() - t0 < timeout, f"fewer than {n} calls in {timeout:.0f} s"
        time.sleep(0.5)


def _worker_pids(workdir: Path, version: str) -> list[list[int]]:
    """The pids of ``version``'s workers, per replica."""
    return [
        sorted(
            int(w["pid"]) for m in manage.describe(ts, MODEL, version) or [] for w in m["workers"]
        )
        for ts in replicas(workdir)
    ]


def test_rollout_refusal_restart_and_rollback_under_load(
    versions: tuple[Path, dict[str, Path], Path], tmp_path: Path
) -> None:
    store, exports, data = versions
    workdir = tmp_path / "serve"
    env = _env({"RECSYS_SERVE_DIR": str(workdir), "RECSYS_MODEL_STORE": str(store)})
    start, gateway_port, metrics_port = start_supervisor(
        exports["1"] / "schema.json",
        env,
        "--replicas",
        "2",
        "--torchserve.workers",
        "1",
        timeout=300,
    )
    restarted: subprocess.Popen[bytes] | None = None
    try:
        assert start.returncode == 0, start.stderr
        target, metrics_at = f"127.0.0.1:{gateway_port}", f"127.0.0.1:{metrics_port}"
        token = client_token(str(workdir / "gateway_token"))
        assert token
        plan_file = Path(read_state(workdir)["plan"])
        make = shutil.which("make")
        assert make, "make not found: `apt-get install make`"
        venv = Path(sys.executable).parent.parent

        def run(target: str, *args: str) -> subprocess.CompletedProcess[str]:
            """``make rollout`` / ``make rollback`` as a user runs them (this venv, not rebuilt)."""
            cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", target,
                   f"VENV={venv}", f"EVAL_DATA={data}", *args]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=600)  # fmt: skip
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return proc

        steps = "--dwell-s 2 --drain-s 2 --no-progress"

        with locust(target, data, tmp_path / "load-1", env) as load:
            ok = run("rollout", "VERSION=2", f"ROLLOUT_ARGS=--margin 0.05 {steps}")
            assert ok.returncode == 0, ok.stderr
            assert "promote v2 to default" in ok.stdout
            rows, want = _expected(exports["2"])
            got, served = _scores(target, token, rows)
            assert served == "2"
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)  # v2's artifact, not v1's

            # judged on its own unseen rows (no EVAL_DATA): its test split, new to v2 too
            bad = run("rollout", "VERSION=3", "EVAL_DATA=", f"ROLLOUT_ARGS=--margin 0.002 {steps}")
            assert bad.returncode != 0, bad.stderr  # make: exit 2 for the command's exit 1
            assert (
                f"evaluation rows: rows 19001..20000 of {data} (unseen by {MODEL} v3: its test split"
                in bad.stdout
            )
            assert "unseen by the candidate v3: yes (within the rows" in bad.stdout
            assert "by the default v2: yes (within the rows" in bad.stdout
            assert "refused: v3 is withdrawn; v2 keeps all traffic" in bad.stdout
        assert load["requests"] > 100 and load["failures"] == 0, load
        plan = plan_io.load(plan_file)  # v1 kept loaded (no traffic of its own) for rollback
        assert (plan.default, list(plan.versions), plan.traffic) == ("2", ["1", "2"], {})
        assert plan.previous == "1"
        # the gateway names the plan file it applied: what the rollout waited on was its own
        applied = _metric(metrics_at, "recsys_gateway_plan_generation", "plan")
        assert applied == {str(plan_file.resolve()): plan.generation}, applied
        for ts in replicas(workdir):  # v1 kept, v3 withdrawn and unregistered
            assert manage.versions(ts, MODEL) == {"1": 1, "2": 1}
        # requests per version, by status code: not one failed
        text = canary.scrape(f"http://{metrics_at}/metrics") or ""
        outcomes = canary.outcomes(text)
        failed = [(labels, n) for labels, n in canary.samples(text, canary.VERSION_REQUESTS)
                  if labels.get("code") != "OK" and n]  # fmt: skip
        assert not failed, failed
        seen = {v: total for v, (total, _) in outcomes.items()}
        assert seen.get("1", 0) > 0 and seen.get("2", 0) > 0, seen  # both took Locust's calls
        # v3 answered its evaluation's requests (which name it) and not one of Locust's: its
        # evaluation was on its unseen rows, its test split (the last 5% with the defaults)
        _, count = evaluate.row_window(data, 0.05, 0)
        assert seen.get("3") == math.ceil(count / 1000), seen

        # a replica that restarts loads the plan's versions, not the archive it started with
        state = read_state(workdir)["replicas"][1]
        ts = replicas(workdir)[1]
        process.stop(state["pid"])
        restarted = process.start(ts)
        process.wait_ready(ts, STARTUP_TIMEOUT_S, restarted)
        for v in ("1", "2"):
            manage.wait_ready(ts, MODEL, v, STARTUP_TIMEOUT_S)
        assert manage.versions(ts, MODEL) == {"1": 1, "2": 1}
        v1_workers = _worker_pids(workdir, "1")

        with locust(target, data, tmp_path / "load-2", env) as load:
            _wait_calls(metrics_at, 50)  # the rollback takes about a second: load it is under
            t0 = time.monotonic()
            back = run("rollback", "ROLLOUT_ARGS=--drain-s 2")
            took = time.monotonic() - t0
            assert back.returncode == 0, back.stderr
            # within the grace: v1 was still loaded; set-default and one plan switch, no
            # registration (the same worker processes, READY before the command started)
            assert back.stdout.count(f"{MODEL} v1 READY already (loaded)") == 2, back.stdout
            assert "[2/6] v1 is in the plan already (kept loaded)" in back.stdout
            assert _worker_pids(workdir, "1") == v1_workers
            done = next(ln for ln in back.stdout.splitlines() if ln.startswith("done in "))
            print(f"rollback within the grace: {done} (`make rollback`: {took:.1f} s)")
            rows, want = _expected(exports["1"])
            got, served = _scores(target, token, rows)
            assert served == "1"
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
            assert _scores(target, token, rows, version="2")[1] == "2"  # v2 kept in its turn
            kept = run("rollout")  # no VERSION: within v2's grace, nothing to do
            assert kept.returncode == 0 and "stays loaded for rollback" in kept.stdout, kept
            time.sleep(1.5)
            gone = run("rollout", "ROLLOUT_ARGS=--keep-previous-s 1 --drain-s 1")  # grace over
            assert gone.returncode == 0, gone.stderr
            assert "release v2 (previous): its grace of 1 s is over" in gone.stdout, gone.stdout
            with pytest.raises(InferenceServerException, match=r"NOT_FOUND|not served"):
                _scores(target, token, rows, version="2")  # drained and unregistered
        assert load["requests"] > 50 and load["failures"] == 0, load
        plan = plan_io.load(plan_file)
        assert (plan.default, list(plan.versions), plan.previous) == ("1", ["1"], "2")
        for ts in replicas(workdir):
            assert manage.versions(ts, MODEL) == {"1": 1}
    except Exception:
        print((workdir / "gateway.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        if restarted is not None:
            process.stop(restarted)
        run_python("serving.tools.supervisor", "stop", env=env, timeout=300)
