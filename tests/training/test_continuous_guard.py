"""The continuous loop's quarantine checks and publish outcomes, as functions (issue 47 items 3
and 4; end to end: test_continuous_poison.py, and test_continuous.py's second run of a config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from serving.tools import canary
from training.continuous.config import parse_args
from training.continuous.poison import auc_words, move, suspect
from training.continuous.served import Outcomes, pin, pinned, step_of

RECENT = [{"file": f"day_{d}.tsv", "auc": 0.72 + d / 100, "label_rate": 0.25, "step": 78 * d}
          for d in range(1, 4)]  # fmt: skip


def test_a_file_like_the_recent_ones_passes() -> None:
    mine = {"auc": 0.70, "label_rate": 0.27, "step": 312}
    assert suspect(mine, RECENT, 3.0, 0.15) == []


def test_inverted_labels_are_named_never_near_chance() -> None:
    mine = {"auc": 0.27, "label_rate": 0.75, "step": 312}
    checks = {c["check"]: c for c in suspect(mine, RECENT, 3.0, 0.15)}
    assert set(checks) == {"label_rate", "auc"}
    assert checks["label_rate"]["odds_factor"] == 9.0  # 3 against 1/3
    reason = checks["auc"]["reason"]
    assert "labels look inverted" in reason and "near chance" not in reason, reason
    assert "0.2700 against a median 0.7400" in reason and "quarantine_auc_drop" in reason
    assert auc_words(0.25).endswith("labels look inverted") and auc_words(0.52) == "near chance"
    # the canary's words for a default scoring 0.25: inverted, not chance
    why = canary.misfit({"auc": 0.25, "normalized_entropy": 1.4})
    assert why is not None and "labels look inverted" in why and "near chance" not in why
    assert "near chance" in str(canary.misfit({"auc": 0.52, "normalized_entropy": 0.99}))


def test_bounds_off_and_no_history() -> None:
    mine = {"auc": 0.27, "label_rate": 0.75, "step": 312}
    assert suspect(mine, RECENT, 0, 0) == []
    assert suspect(mine, [], 3.0, 0.15) == []
    untrained = [{**r, "step": 0} for r in RECENT]  # scored by a fresh model: no AUC reference
    assert [c["check"] for c in suspect(mine, untrained, 3.0, 0.15)] == ["label_rate"]


def test_the_config_keys_and_their_defaults() -> None:
    c = parse_args(["--data-dir", "x", "--run-dir", "/nonexistent/run"]).config.continuous
    assert (c.quarantine_window, c.quarantine_label_odds, c.quarantine_auc_drop) == (5, 3.0, 0.15)
    assert c.after_refusal == "served" and c.require_publish
    try:
        parse_args(["--data-dir", "x", "continuous.after_refusal=last"])
    except Exception as e:  # ConfigError
        assert "served, candidate" in str(e)
    else:
        raise AssertionError("after_refusal=last accepted")


def test_publish_outcomes() -> None:
    kind = Outcomes.kind
    export = {"event": "export", "ok": True, "step": 78, "version": "78"}
    assert kind([export])[0] == "published"
    assert kind([{**export, "ok": False, "error": "error: x from another run"}])[0] == "failed"
    rollout = {"event": "rollout", "step": 78, "version": "78", "from": "1"}
    assert kind([export, {**rollout, "promoted": True}])[0] == "published"
    refused = {**rollout, "promoted": False, "reason": "refused: v78 is withdrawn",
               "auc_candidate": 0.50, "auc_default": 0.70}  # fmt: skip
    assert kind([export, refused])[0] == "refused" and Outcomes.on_figures(refused)
    traffic = {**refused, "auc_candidate": 0.71}  # the error gate, not the figures
    assert kind([export, traffic])[0] == "refused" and not Outcomes.on_figures(traffic)
    other = {**rollout, "promoted": False, "reason": "the stack serves dlrm-other, not dlrm-x"}
    assert kind([export, other])[0] == "not_rolled_out"
    broke = {**rollout, "promoted": False, "reason": "error: no gateway"}
    assert kind([export, broke])[0] == "failed"
    delta = {"event": "delta", "step": 78, "promoted": False, "gate": {"passed": False}}
    assert kind([delta])[0] == "refused"
    assert kind([{**delta, "gate": None, "reason": "delta not made: x"}])[0] == "failed"
    assert step_of("195") == 195 and step_of("195-abcd1234") == 195 and step_of("x") is None


def _checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"dcp")
    (path / "meta.json").write_text(json.dumps({"progress": {"step": step}}))
    return path


def test_the_served_checkpoint_is_pinned_by_hard_links(tmp_path: Path) -> None:
    run = tmp_path / "run"
    a = _checkpoint(run / "checkpoints" / "step_00000078", 78)
    b = _checkpoint(run / "checkpoints" / "step_00000156", 156)
    assert pinned(run) is None
    first = pin(run, a)
    assert pinned(run) == first and os.path.samefile(first / ".metadata", a / ".metadata")
    second = pin(run, b)
    assert pinned(run) == second and not first.exists()  # one version pinned


def test_a_quarantined_file_moves_with_its_sidecar_and_reason(tmp_path: Path) -> None:
    (tmp_path / "day_2.tsv").write_text("1\t2\n")
    (tmp_path / "day_2.prob.npy").write_bytes(b"x")
    where = move(tmp_path / "day_2.tsv", "labels look inverted")
    assert where == tmp_path / "quarantine" / "day_2.tsv" and where.is_file()
    assert (tmp_path / "quarantine" / "day_2.prob.npy").is_file()
    assert "labels look inverted" in (tmp_path / "quarantine" / "day_2.tsv.reason.txt").read_text()
