"""The rollout's gates: what lets a candidate version go on to more traffic.

* the **evaluation** gate (:func:`compare`): the candidate's AUC through the gateway, on the same
  labelled rows as the default's, may be lower by ``margin`` at most; and the rows must fit the
  served model (:func:`misfit`): a default scoring near chance on them (AUC < 0.55 or NE > 1)
  means they are not data of its kind, and two such figures compared say nothing;
* the **error** gate (:class:`ErrorGate`): while the canary steps shift traffic, the candidate's
  error ratio may exceed the default's by ``max_error_excess`` at most. Its :class:`Verdict` is
  pass, fail or *not judged* (fewer than ``error_min_requests`` candidate requests, metrics off
  or unreachable): a step that is not judged waits on, never counts as a pass.

The error gate reads the gateway's ``/metrics``: ``recsys_gateway_version_requests_total
{model_version,code}`` counts each version's requests by the status code their scoring ended with
(serving/gateway/metrics.py); a request is an error when that code is not OK (the backend failed
it: the handler refused it, the model raised, no answer in time). Both versions are compared over
the same window (from the first traffic step on: the evaluation's calls, which name their version,
are not part of it), under the same load, so a failure of the whole stack does not count against
the candidate alone. Readiness is the gateway's business (a version whose probe fails takes no
traffic); this gate catches a candidate that passes the probe and fails real requests.
"""

from __future__ import annotations

import enum
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from recsys_stack.auc_stats import compare_scored

VERSION_REQUESTS = "recsys_gateway_version_requests_total"
PLAN_GENERATION = "recsys_gateway_plan_generation"

MIN_AUC = 0.55  # below: the default ranks the evaluation rows barely better than chance
MAX_NE = 1.0  # above: it predicts them worse than their average click rate would
Outcomes = dict[str, tuple[float, float]]
"""``{version: (requests, errors)}``, as counted since the gateway started."""


def scrape(url: str, timeout: float = 5.0, token: str = "") -> str | None:
    """The metrics text at ``url`` (None: nothing answers there, or it refuses ``token``:
    the gateway's ``metrics.token_file``, empty = none sent)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as r:  # fmt: skip
            text: str = r.read().decode()
    except OSError:
        return None
    return text


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample named ``name`` in Prometheus text."""
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def plan_generation(text: str, plan_file: Path) -> int | None:
    """The generation of ``plan_file`` the gateway applied (None: it runs another plan file)."""
    mine = str(Path(plan_file).resolve())
    found = [v for labels, v in samples(text, PLAN_GENERATION) if labels.get("plan") == mine]
    return int(found[0]) if found else None


def outcomes(text: str) -> Outcomes:
    """Each version's requests and errors (non-OK codes) from the gateway's metrics text."""
    out: Outcomes = {}
    for labels, value in samples(text, VERSION_REQUESTS):
        version = labels.get("model_version", "")
        total, errors = out.get(version, (0.0, 0.0))
        out[version] = (total + value, errors + (value if labels.get("code") != "OK" else 0.0))
    return out


class Verdict(enum.Enum):
    """What the error gate concluded. Only ``PASS`` lets a rollout go on: ``NOT_JUDGED`` (too
    few candidate requests, metrics off or unreachable) is uncertainty, never success."""

    PASS = "pass"
    FAIL = "fail"
    NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    seen: str
    """What was seen, in one line (the counts and the reason of the verdict)."""


@dataclass
class ErrorGate:
    """The candidate's error ratio against the default's, counted from ``start`` on."""

    default: str
    candidate: str
    max_excess: float
    """Most the candidate's error ratio may exceed the default's (0.01: one point)."""
    min_requests: int
    """Candidate requests in the window before it is judged (fewer: too few to tell)."""
    start: Outcomes | None
    """The counters when the window opened (None: the gateway's metrics are off)."""

    def window(self, now: Outcomes, version: str) -> tuple[float, float]:
        assert self.start is not None
        t0, e0 = self.start.get(version, (0.0, 0.0))
        t1, e1 = now.get(version, (0.0, 0.0))
        return t1 - t0, e1 - e0

    def check(self, now: Outcomes | None) -> Judgement:
        """``FAIL`` once the candidate has ``min_requests`` requests in the window and its error
        ratio exceeds the default's by more than ``max_excess``, ``PASS`` when it has them and
        does not, ``NOT_JUDGED`` before it has them or while the metrics do not answer."""
        if self.start is None or now is None:
            return Judgement(
                Verdict.NOT_JUDGED,
                "error gate cannot judge: the gateway's metrics are off or unreachable",
            )
        (cn, ce), (dn, de) = self.window(now, self.candidate), self.window(now, self.default)
        cand, base = ce / cn if cn else 0.0, de / dn if dn else 0.0
        seen = (
            f"errors v{self.candidate} {ce:.0f}/{cn:.0f} ({cand:.1%}), "
            f"v{self.default} {de:.0f}/{dn:.0f} ({base:.1%})"
        )
        if cn < self.min_requests:
            return Judgement(
                Verdict.NOT_JUDGED, f"{seen}: fewer than {self.min_requests} requests, not judged"
            )
        if cand - base > self.max_excess:
            over = f"{cand - base:+.1%} over the allowed {self.max_excess:+.1%}"
            return Judgement(Verdict.FAIL, f"{seen}: {over}")
        return Judgement(Verdict.PASS, f"{seen}: within {self.max_excess:+.1%}")


def misfit(base: dict[str, Any]) -> str | None:
    """Why the evaluation rows do not fit the served model, judged by its own figures on them
    (``base``: AUC < :data:`MIN_AUC` or NE > :data:`MAX_NE`); None when they fit."""
    auc, ne = float(base["auc"]), float(base["normalized_entropy"])
    if auc >= MIN_AUC and ne <= MAX_NE:
        return None
    if auc < 1 - MIN_AUC:  # ranked the wrong way round: not chance, the labels' meaning
        what = f"below chance: AUC < {1 - MIN_AUC:g}, labels look inverted"
    else:
        what = f"near chance: AUC < {MIN_AUC} or NE > {MAX_NE:g}"
    return (
        f"scores AUC {auc:.5f}, NE {ne:.5f} on these rows ({what}): the evaluation data does "
        "not fit the model; evaluate on its own data (the default), or pass EVAL_DATA=FILE.tsv "
        "(--eval-data) of its kind"
    )


def paired_line(base: dict[str, Any], cand: dict[str, Any]) -> str:
    """The candidate against the default on the same rows, DeLong's paired test (both
    evaluations' ``scored`` rows, :class:`serving.tools.evaluate.Figures`); "" without them."""
    a, b = getattr(cand, "scored", None), getattr(base, "scored", None)
    if a is None or b is None:
        return ""
    try:
        c = compare_scored(a, b)
    except ValueError:  # other rows (RowsDiffer), or too few of a class
        return ""
    return f"  paired test (DeLong, 95%): the candidate is {c}"


def compare(base: dict[str, Any], cand: dict[str, Any], margin: float) -> tuple[bool, str]:
    """``(accept, table)``: the candidate passes when its AUC is at least the default's minus
    ``margin`` on rows the default fits (:func:`misfit`); on rows only the candidate fits, it
    passes (the default is the bad one); on rows neither fits, it is refused."""
    rows = [("AUC", "auc"), ("NE", "normalized_entropy"), ("log loss", "log_loss"),
            ("calibration", "calibration")]  # fmt: skip
    lines = [f"  {'':12} {'default':>10} {'candidate':>10} {'delta':>10}"]
    for label, key in rows:
        a, b = float(base[key]), float(cand[key])
        lines.append(f"  {label:12} {a:10.5f} {b:10.5f} {b - a:+10.5f}")
    if why := misfit(base):
        # a default near chance says nothing against a candidate that fits the rows (they are
        # the candidate's own unseen ones by default): it is the default that is bad
        if cand_why := misfit(cand):
            lines.append(f"  refused: neither fits these rows; the candidate {cand_why}")
            return False, "\n".join(lines)
        lines.append(f"  accepted: the default {why.split(':')[0]}, the candidate does not")
        return True, "\n".join(lines)
    if line := paired_line(base, cand):
        lines.append(line)
    change = float(cand["auc"]) - float(base["auc"])
    ok = change >= -margin
    lines.append(
        f"  AUC change {change:+.5f}, allowed down to {-margin:+g}: "
        f"{'accepted' if ok else 'refused'}"
    )
    return ok, "\n".join(lines)
