"""Defaults that follow the model: ``make score``, ``make evaluate`` and ``make rollout`` without
``DATA=`` take the rows the model never trained on (recorded in its schema.json by the export:
the tiny batch run's test split; the rollout's, the candidate's, checked against the
default's record), say which and why, and refuse with one line when that data is gone or
changed; a rollout on rows the served model scores near chance on is refused before anything
changes. The Makefile's own targets against a real ``make serve`` of the tiny run's export.

The archives are the tiny export's, their data record pointing at a copy of the tiny run's
synthetic TSV (the data "moved" to this test's folder) so that the test may change and delete
it; v2.0 is v1.0's weights under another version, for a rollout that is accepted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from recsys_stack.metrics import roc_auc
from recsys_stack.net import free_ports
from serving import plan as plan_io
from serving.tools.state import read_state
from serving.worker.codec import to_rows
from tests.conftest import ROOT, _env

pytestmark = pytest.mark.slow
MODEL = "dlrm-tiny"
PORT_VARS = ["INFERENCE", "MANAGEMENT", "METRICS", "GRPC_INFERENCE", "GRPC_MANAGEMENT"]


def relocated(src: Path, out: Path, version: str, data: Path) -> None:
    """The archive ``src`` as ``version``, its schema's data record (and the unseen rows in it,
    its test split) naming ``data``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        manifest = json.loads(zin.read("MAR-INF/MANIFEST.json"))
        manifest["model"]["modelVersion"] = version
        schema = json.loads(zin.read("schema.json"))
        schema["model"]["version"] = version
        schema["data"]["files"][0]["path"] = str(data)
        schema["data"]["unseen"]["files"][0]["path"] = str(data)
        replaced = {"MAR-INF/MANIFEST.json": manifest, "schema.json": schema}
        for item in zin.infolist():
            body = replaced.get(item.filename)
            zout.writestr(item, json.dumps(body).encode() if body else zin.read(item))


def tsv_lines(s: np.lib.npyio.NpzFile, labels: np.ndarray) -> str:
    """The sample's rows as Criteo TSV lines with ``labels``."""
    sparse = to_rows(s["values"], s["lengths"])
    lines = []
    for y, dense, ids in zip(labels, s["dense"], sparse, strict=True):
        ints = [str(int(x)) if x else "" for x in dense]
        hexes = [f"{int(x):08x}" if x >= 0 else "" for x in ids]
        lines.append("\t".join([str(int(y)), *ints, *hexes]))
    return "\n".join(lines) + "\n"


def only_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The tool's stderr without make's own ``make: ***`` line: exactly one ``error:`` line."""
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: "), lines
    return lines[0]


def test_score_evaluate_rollout_default_to_the_rows_the_model_never_trained_on(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, shared_store, _ = exported
    schema = json.loads((export / "schema.json").read_text())
    record = schema["data"]
    (trained_on,) = [Path(f["path"]) for f in record["files"]]
    assert trained_on.is_file() and record["eval_rows"] == 2000 and record["rows"] == 20000
    assert record["test_rows"] == 1000  # the held-out rows' second half: what no choice saw
    data = tmp_path / "data" / trained_on.name  # the data, moved: this test may change it
    data.parent.mkdir()
    shutil.copy(trained_on, data)
    store = tmp_path / "store"
    store.mkdir()
    for version in ("1.0", "2.0"):
        relocated(
            shared_store / f"{MODEL}-1.0.mar", store / f"{MODEL}-{version}.mar", version, data
        )
    parity = json.loads((export / "parity.json").read_text())
    s = np.load(export / "sample.npz")  # the 1,000 test rows, their served scores
    served = schema["served_variant"]

    make = shutil.which("make")
    assert make, "make not found: `apt-get install make`"
    ports = free_ports(7)
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
    env |= {"RECSYS_GATEWAY_PORT": str(ports[5]), "RECSYS_GATEWAY_METRICS_PORT": str(ports[6]),
            "RECSYS_SERVE_DIR": str(tmp_path / "serve")}  # fmt: skip
    venv = Path(sys.executable).parent.parent
    common = [f"VENV={venv}", f"RUN={export.parent}", f"OUT={tmp_path / 'report'}",
              f"SERVE_ARGS=--torchserve.model-store {store} --torchserve.workers 1"]  # fmt: skip

    def run(target: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", target, *common, *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        print(target, proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        return proc

    why = ("its test split, the last 1000 rows (data.eval_fraction 0.1, data.valid_fraction 0.5): "
           "no training decision saw them (the 1000 validation rows before them chose the "
           "checkpoint)")  # fmt: skip
    own = f"rows 19001..20000 of {data} (unseen by {MODEL} v1.0: {why})"
    started = run("serve")
    try:
        assert started.returncode == 0, started.stderr
        # make score: the first test rows of the model's own file, said on stderr
        scored = run("score", "ROWS=10")
        assert scored.returncode == 0, scored.stderr
        assert f"scoring rows 19001..19010 of {data} (unseen by {MODEL} v1.0: " in scored.stderr
        got = [float(line.split("\t")[1]) for line in scored.stdout.splitlines()[-10:]]
        np.testing.assert_allclose(got, s[f"probs_{served}"][:10], atol=1e-6)
        # make evaluate: all 1,000 test rows, the export's parity AUC
        evaluated = run("evaluate")
        assert evaluated.returncode == 0, evaluated.stderr
        assert f"scoring {own}" in evaluated.stderr
        assert f"1000 rows of {data} (the default version)" in evaluated.stdout
        report = json.loads((tmp_path / "report" / "evaluation.json").read_text())
        assert report["first_row"] == 19001 and report["rows"] == 1000
        assert abs(report["auc"] - parity["auc"][served]) <= 5e-4, (report, parity["auc"])
        # make rollout: evaluates on the candidate's unseen rows, new to the default too
        rolled = run("rollout", "VERSION=2.0", "ROLLOUT_ARGS=--steps 100 --drain-s 0 --no-progress")
        assert rolled.returncode == 0, rolled.stderr
        assert f"evaluation rows: {own.replace('v1.0', 'v2.0')}" in rolled.stdout
        assert (f"unseen by the candidate v2.0: yes (within the rows {MODEL} v2.0 never trained "
                f"on); by the default v1.0: yes (within the rows {MODEL} v1.0 never trained on)"
                in rolled.stdout), rolled.stdout  # fmt: skip
        steps = [ln[:5] for ln in rolled.stdout.splitlines() if ln.startswith("[")]
        assert steps == [f"[{i}/6]" for i in range(1, 7)], rolled.stdout
        plan_file = Path(read_state(tmp_path / "serve")["plan"])
        assert plan_io.load(plan_file).default == "2.0"

        # rows the served model scores near chance on: the held-out rows, labels shuffled
        labels = np.random.default_rng(0).permutation(s["labels"])
        assert roc_auc(labels, s[f"probs_{served}"]) < 0.55  # the premise
        shuffled = tmp_path / "shuffled.tsv"
        shuffled.write_text(tsv_lines(s, labels))
        generation = plan_io.load(plan_file).generation
        unfit = run("rollout", "VERSION=1.0", f"EVAL_DATA={shuffled}",
                    "ROLLOUT_ARGS=--holdout 0 --no-progress")  # fmt: skip
        assert unfit.returncode != 0
        # a default near chance no longer refuses by itself (a bad default must not block a
        # better candidate): the candidate is judged too, and on rows neither fits, refused
        assert "v2.0 (the default) scores AUC" in unfit.stdout, unfit.stdout
        assert "refused: neither fits these rows" in unfit.stdout, unfit.stdout
        after = plan_io.load(plan_file)
        assert after.default == "2.0" and after.generation > generation

        # the data changed since the export: one line each, naming the file; DATA= still works
        with data.open("a") as f:
            f.write(data.read_text().splitlines()[0] + "\n")
        for target, args, who in (("score", [], "v2.0"), ("evaluate", [], "v2.0"),
                                  ("rollout", ["VERSION=1.0"], "v1.0")):  # fmt: skip
            line = only_error(run(target, *args))
            assert f"{data} is not the file {MODEL} {who}'s unseen rows are in" in line, line
            assert line.endswith("to choose"), line
        data.unlink()
        line = only_error(run("score"))
        assert f"{MODEL} v2.0's unseen rows are in {data}, which is missing" in line, line
        assert "pass DATA=FILE.tsv (make) or --data FILE.tsv to choose" in line
        chosen = run("score", f"DATA={trained_on}", "ROWS=3")
        assert chosen.returncode == 0 and f"rows 1..3 of {trained_on}" in chosen.stderr
        # stdout is the scores alone, each row numbered as the stderr line counts them
        assert [ln.split("\t")[0] for ln in chosen.stdout.splitlines()] == ["1", "2", "3"]
    finally:
        run("stop")
    # nothing serving: the default is refused with the way out, and so is a score without one
    line = only_error(run("score"))
    assert "nothing is serving from" in line and "`make serve`" in line, line
    unreached = run("score", f"DATA={trained_on}")  # after the line saying which rows
    last = unreached.stderr.splitlines()[-2]  # make's own line is the last
    assert unreached.returncode != 0 and last.startswith("error: UNAVAILABLE: no gateway"), last
    assert "`make serve`" in last, last
