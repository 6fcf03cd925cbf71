"""docs/quickstart.ipynb runs top to bottom as a user runs it (issue 31: executed by the suite so
that it cannot rot): nbclient executes it in a kernel of this venv (``python3`` is the running
interpreter through ipykernel) from the repository root, with its one parameter cell pointing
the run and the data at a temporary folder. What the cells printed and drew is checked, then
that nothing it started is left running: nbclient stops at the first failing cell, so the test
stops the stack itself from the run's serving state and kills any process left that names the
run folder (a trainer, TorchServe, the gateway)."""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest

from tests.conftest import ROOT, _env
from tests.stack import ours

NOTEBOOK = ROOT / "docs" / "quickstart.ipynb"
CELL_TIMEOUT_S = 600


def load() -> Any:
    return nbformat.read(NOTEBOOK, as_version=4)


def tagged(nb: Any, tag: str) -> Any:
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{NOTEBOOK.name}: {len(cells)} cells tagged {tag!r}"
    return cells[0]


def text(cell: Any) -> str:
    """What a code cell printed (streams, and the plain text of its results)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def images(cell: Any) -> list[str]:
    return [
        o.data["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})
    ]


def test_the_notebook_is_stored_clean_with_one_parameter_cell() -> None:
    nb = load()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"{NOTEBOOK.name}: code cells {dirty} hold outputs (clear them before saving)"
    params = tagged(nb, "parameters")
    assert params is code[0], "the parameters cell is the first code cell"
    assigned = {t.id for n in ast.parse(params.source).body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
    assert assigned == {"RUN", "DATA"}, assigned


def stop_everything(run: Path) -> list[str]:
    """``make stop`` for the run's stack, then kill what still names the run; what was left."""
    subprocess.run(
        [sys.executable, "-m", "serving.tools.supervisor", "stop", "--workdir", str(run / "serve")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    left = ours(run)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=30)
    return [" ".join(p.info["cmdline"] or [])[:200] for p in left]


@pytest.mark.slow
def test_the_quickstart_notebook_runs(tmp_path: Path) -> None:
    from nbclient import NotebookClient

    nb = load()
    run, data = tmp_path / "run", tmp_path / "data"
    params = f"from pathlib import Path\n\nRUN = Path({str(run)!r})\nDATA = Path({str(data)!r})\n"
    tagged(nb, "parameters").source = params
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "docs")}},  # where Jupyter opens it
    )  # fmt: skip
    try:
        client.execute(env=_env())
    finally:
        nbformat.write(nb, tmp_path / "executed.ipynb")  # what each cell showed, to read after
        left = stop_everything(run)
    assert not left, f"processes of the run outlived the notebook: {left}"

    train = text(tagged(nb, "train"))
    assert "$ torchrun --standalone --nproc_per_node=2 -m training.train" in train, train[:500]
    final = json.loads(next(ln for ln in train.splitlines() if ln.startswith('{"final"')))["final"]
    assert 0.6 < final["auc"] <= final["oracle_auc"] + 0.02, final  # it learned the signal
    assert f"final: step {final['step']}, AUC {final['auc']:.4f}" in train

    plan = text(tagged(nb, "plan"))
    assert "t_C1    column_wise" in plan and "t_C2    table_wise" in plan, plan
    sharded = [ln for ln in plan.splitlines() if ln.startswith("t_C")]
    replicated = int(plan.split("data_parallel (replicated on every rank): ")[1].split()[0])
    assert len(sharded) + replicated == 26, plan  # every table placed, each once

    curves = tagged(nb, "curves")
    assert len(images(curves)) == 1 and "evaluations; last: AUC" in text(curves)

    export = text(tagged(nb, "export"))
    assert "ok   |ΔAUC| int8 vs eager" in export and "parity passed" in export, export[-2000:]
    assert list((run / "model_store").glob("dlrm-tiny-*.mar"))

    serve = text(tagged(nb, "serve"))
    assert "serving dlrm-tiny" in serve and "SERVING" in serve, serve[-2000:]

    score = text(tagged(nb, "score"))
    scores = ast.literal_eval(
        next(ln for ln in score.splitlines() if ln.startswith("scores: "))[8:]
    )
    assert len(scores) == 5 and all(0.0 < s < 1.0 for s in scores), score
    assert "unseen by dlrm-tiny" in score and "its test split" in score, score

    calibration = tagged(nb, "calibration")
    shown = text(calibration)
    assert len(images(calibration)) == 1 and (run / "calibration.png").stat().st_size > 0
    served_auc = float(shown.split("served AUC ")[1].split(";")[0])
    assert abs(served_auc - final["auc"]) < 2e-3, shown  # the served int8 model, same rows
    assert shown.count("bucket ") == 10, shown

    stop = text(tagged(nb, "stop"))
    assert "stopped gateway, torchserve" in stop and "not running" in stop, stop
    assert not (run / "serve" / "serve.json").exists()
    # nothing written into the repository: the data, the run and the model store are under tmp
    assert sorted(p.name for p in data.iterdir()) == ["cache", "synthetic"]
