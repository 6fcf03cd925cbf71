"""The online demo's accounting and click-to-served figure on hand-made logs (the demo itself
runs every part: ``make demo-online``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from loadtest import online_report as rep
from recsys_stack.online import CLICKS, IMPRESSIONS, file_name

ROW = "\t".join(["1"] * 13 + ["a"] * 26)


def _write(folder: Path, kind: str, recs: list[dict[str, object]]) -> None:
    (folder / kind).mkdir(parents=True, exist_ok=True)
    (folder / kind / file_name(kind, "w", 0)).write_text(
        "".join(json.dumps(r) + "\n" for r in recs)
    )
    (folder / kind / f".{file_name(kind, 'w', 1)}.tmp").write_text("not json: an open file\n")


def test_expected_rows_label_by_the_window_and_leave_open_windows_out(tmp_path: Path) -> None:
    imp = [{"request_id": f"r{k}", "example": 0, "event_time_ms": 1000 * k, "row": f"{k}\t{ROW}"}
           for k in range(5)]  # fmt: skip
    imp.append({"request_id": "r9", "example": 0, "event_time_ms": 0, "row": None})
    _write(tmp_path, IMPRESSIONS, imp)
    _write(tmp_path, CLICKS, [
        {"request_id": "r0", "example": 0, "event_time_ms": 500, "label": 1},  # in window
        {"request_id": "r0", "example": 0, "event_time_ms": 600, "label": 1},  # duplicate
        {"request_id": "r1", "example": 0, "event_time_ms": 9000, "label": 1},  # after W
        {"request_id": "r2", "example": 0, "event_time_ms": 2500, "label": 0},  # not a click
        {"request_id": "r3", "example": 1, "event_time_ms": 3100, "label": 1},  # other example
    ])  # fmt: skip
    want, counts = rep.expected_rows(tmp_path, 2.0, closed_before_ms=5500)
    assert counts == {"impressions": 6, "unwritable": 1, "window_open": 1}  # r4: 4 s + 2 s
    assert want == Counter({f"1\t0\t{ROW}": 1, f"0\t1\t{ROW}": 1, f"0\t2\t{ROW}": 1,
                            f"0\t3\t{ROW}": 1})  # fmt: skip


def test_accounting_tells_lost_doubled_mislabelled_and_unexpected_rows() -> None:
    want = Counter({"1\ta": 1, "0\tb": 2, "0\tc": 1, "1\td": 1})
    got = Counter({"1\ta": 2, "0\tb": 1, "1\tc": 1, "0\te": 1})  # d lost, b one lost
    assert rep.accounting(want, got) == {"expected": 5, "joined": 5, "lost": 2, "doubled": 1,
                                         "unexpected": 1, "mislabelled": 1}  # fmt: skip
    assert rep.accounting(want, want)["lost"] == rep.accounting(want, want)["mislabelled"] == 0


def test_click_to_served_ends_at_the_first_promoted_delta_trained_on_the_clicks_file() -> None:
    events = [
        {"event": "file", "file": "joined-1"},
        {"event": "delta", "after": "joined-1", "promoted": False, "acked_at": 50.0},
        {"event": "file", "file": "joined-2"},
        {"event": "delta", "after": "joined-2", "promoted": True, "acked_at": 60.0},
        {"event": "file", "file": "joined-3"},
    ]
    manifest = [{"name": "joined-1", "click_event_ms": [10_000, 20_000]},
                {"name": "joined-2", "click_event_ms": [40_000]},
                {"name": "joined-3", "click_event_ms": [55_000]}]  # fmt: skip
    f = rep.freshness(manifest, events)
    assert f == {"clicks": 3, "unserved": 1, "p50_s": 40.0, "p95_s": 50.0, "max_s": 50.0}
