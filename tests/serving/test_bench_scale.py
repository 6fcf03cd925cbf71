"""``make bench-scale``'s confinement, in process and in seconds: a process born in a memory
group is charged there (one moved in later is not: why the bench starts TorchServe inside),
the working set is the int8 pages the sent requests read, a fraction whose share holds the
working set is not run, and the table refuses "confined" figures from a group that never
filled. The full run (TorchServe, the Kaggle shape) is ``make bench-scale``, docs/scale.md."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from serving.bench import memgroup
from serving.bench.memgroup import MemoryGroup
from serving.bench.scale import SLACK, ScaleConfig, confined_run
from serving.bench.scale_load import INT8_ROW, PAGE, Load, sent, working_set
from serving.bench.scale_report import closing, confined_table
from serving.torchserve.process import born_in

MIB = 2**20
HOLD = "import sys; b = bytearray({mib} << 20); b[::4096] = b'x' * len(b[::4096]); "
HOLD += "print('ready', flush=True); sys.stdin.readline()"


def _holding(mib: int, cmd: list[str] | None = None) -> subprocess.Popen[str]:
    """A Python child that touches ``mib`` MiB of its own memory, says ready, and waits."""
    argv = [sys.executable, "-c", HOLD.format(mib=mib)]
    child = subprocess.Popen(cmd(argv) if cmd else argv, stdin=subprocess.PIPE,  # type: ignore[operator]
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def test_a_process_born_in_a_group_is_charged_there_one_moved_in_is_not() -> None:
    if why := memgroup.unavailable():
        pytest.skip(why)
    born = MemoryGroup(f"recsys-test-born-{uuid.uuid4().hex[:8]}")
    moved = MemoryGroup(f"recsys-test-moved-{uuid.uuid4().hex[:8]}")
    kids = []
    try:
        kids.append(_holding(64, lambda argv: born_in(born.procs, argv)))
        assert born.members() == [kids[0].pid]  # the exec kept the pid the shell wrote
        kids.append(_holding(64))
        moved.procs.write_text(str(kids[1].pid))
        time.sleep(0.1)
        got = {"born": born.stat()["rss"], "moved": moved.stat()["rss"]}
        print({k: v // MIB for k, v in got.items()}, "MiB charged")
        assert got["born"] >= 64 * MIB  # every page it touched
        assert got["moved"] < 16 * MIB  # what it held stayed charged where it was
        born.limit(born.read("usage_in_bytes") + 8 * MIB)
        assert born.read("failcnt") == 0  # restarted with the limit: nothing has hit it yet
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
        born.remove()
        moved.remove()
    assert not born.path.exists() and not moved.path.exists()


def test_the_working_set_is_the_pages_the_sent_requests_read() -> None:
    rows = [1000, 10]  # the second table starts at row 1000 of the file
    ids = np.zeros((2, 3, 2), dtype=np.int64)
    ids[0, :, 0] = [0, 1, 0]  # rows 0 and 1: one page
    ids[1, :, 0] = [170, 171, 999]  # row 170 straddles pages 0 and 1; row 999: page 5
    ids[:, :, 1] = 0  # table 2, row 0 = file row 1000: page 5
    assert (170 * INT8_ROW) // PAGE == 0 and (171 * INT8_ROW - 1) // PAGE == 1
    assert working_set(ids, rows) == 3 * PAGE  # pages 0, 1, 5
    assert working_set(ids[:1], rows) == 2 * PAGE  # pages 0, 5
    # 8 callers from evenly spaced starts, each a warm-up call and its share: all 64 sent once
    assert sent(64, 56, 8).tolist() == list(range(64))
    assert len(sent(4096, 1000, 8)) == 8 * (125 + 1)  # fewer requests than the list: a part


def test_a_fraction_whose_share_holds_the_working_set_is_not_run(tmp_path: Path) -> None:
    cfg = ScaleConfig(workers=2)
    built = {"int8_table_bytes": 1000 * MIB}  # 50%: 500 MiB + 2 x 64 MiB of room
    load = Load(requests=[], working_set=600 * MIB)
    run = confined_run(built, [], cfg, tmp_path, load, 0.5)
    assert "fits in the group's 628 MiB" in run["skipped"] and SLACK == 64 * MIB


def _result(**confined: object) -> dict[str, object]:
    serve = {"examples_per_s": 20_000.0, "major_faults_per_1k_lookups": 0.5, "p99_ms": 60.0}
    return {"rows": 33_762_577, "int8_table_bytes": 773 * MIB, "serve": serve,
            "confined": {"fraction": 0.5, "limit_bytes": 900 * MIB, "working_set_bytes": 686 * MIB,
                         **confined}}  # fmt: skip


def test_a_confined_row_whose_group_never_filled_prints_no_confined_figures() -> None:
    never = _result(peak_bytes=520 * MIB, failcnt=0, filled=False, examples_per_s=25_000.0,
                    major_faults_per_1k_lookups=2.0, p99_ms=50.0, failed=0)  # fmt: skip
    text = confined_table([never]) + "\n" + closing(never)
    print(text)
    assert "NOT CONFINED: the group never reached its limit" in text
    assert "peak 520 of 900 MiB" in text and "25,000" not in text  # its speed is not shown
    full = _result(peak_bytes=900 * MIB, failcnt=1234, filled=True, examples_per_s=14_000.0,
                   major_faults_per_1k_lookups=25.0, p99_ms=180.0, failed=0)  # fmt: skip
    text = confined_table([full]) + "\n" + closing(full)
    print(text)
    assert "20,000 / 14,000 (70%)" in text and "0.50 / 25.00" in text
    assert "limit 900 MiB, peak 900 MiB, hit 1,234 times" in closing(full)


def test_the_variant_rows_sit_beside_int8_and_show_confined_figures_only_when_filled() -> None:
    from serving.bench.scale_report import variants_table

    r = _result(peak_bytes=900 * MIB, failcnt=1234, filled=True, examples_per_s=14_000.0,
                major_faults_per_1k_lookups=25.0, p99_ms=180.0, failed=0)  # fmt: skip
    r["serve"]["failed"] = 0
    int4_serve = {"examples_per_s": 19_000.0, "major_faults_per_1k_lookups": 0.3, "failed": 0}
    int4_conf = {"filled": True, "examples_per_s": 18_000.0, "major_faults_per_1k_lookups": 2.0,
                 "limit_bytes": 900 * MIB, "failed": 0}  # fmt: skip
    r["variants"] = [
        {"variant": "int4", "table_bytes": 386 * MIB, "abs_delta_auc": 4e-4,
         "int8_abs_delta_auc": 2e-5, "serve": int4_serve, "confined": int4_conf},
        {"variant": "mixed", "table_bytes": 580 * MIB, "abs_delta_auc": 1e-4,
         "int8_abs_delta_auc": 2e-5, "serve": int4_serve,
         "confined": {**int4_conf, "filled": False}},
    ]  # fmt: skip
    text = variants_table([r])
    print(text)
    int8, int4, mixed = text.splitlines()[1:]
    assert "int8 | 773 | 2.0e-05 | 20,000 (100% of int8)" in int8 and "14,000 | 25.00" in int8
    assert "int4 | 386 | 4.0e-04 | 19,000 (95% of int8)" in int4 and "18,000 | 2.00" in int4
    assert "not confined" in mixed and "18,000" not in mixed


def test_a_variant_is_exported_serving_it_with_its_bytes_and_auc(
    trained: Path, tmp_path: Path
) -> None:
    """The bench's own export of the int4 and mixed variants, on the tiny trained run."""
    import shutil

    from serving.bench.scale import export_variant

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export"))
    built = {"run": str(run), "int8_table_bytes": 26 * 128 * (8 + 8)}  # tiny: dim 8
    int4 = export_variant(built, "int4", 0.75, tmp_path)
    assert int4["table_bytes"] == built["int8_table_bytes"] // 2 and int4["formats"] is None
    assert int4["abs_delta_auc"] <= 1e-3 and (Path(int4["store"]) / "scale-1.mar").is_file()
    mixed = export_variant(built, "mixed", 0.75, tmp_path)
    assert int4["table_bytes"] < mixed["table_bytes"] <= 0.75 * built["int8_table_bytes"]
    assert len(mixed["formats"]) == 26 and mixed["abs_delta_auc"] <= 1e-3
