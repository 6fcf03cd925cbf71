"""``make rollout VERSION=<v>`` / ``make rollback``: replace the served model without a failed request.

``python -m serving.tools.rollout --version 2`` works on the stack ``make serve`` started (its
``serve.json``: replicas, gateway, serving plan) and takes these steps, printing each:

1. **register** ``<model>-<v>.mar`` on every TorchServe replica (management API, management
   key; the handler warms the model up while loading), wait until READY everywhere;
2. **add** it to the serving plan with no traffic; the gateway probes it on every replica;
3. **evaluate** the candidate and the current default through the gateway on the same labelled
   rows, rows the candidate never trained on (``--eval-data``; by default those its schema.json
   records as unseen: a batch run's held-out split, a continuous run's next file;
   serving/tools/evaldata.py): AUC, NE, log loss, calibration. Which rows, and whether each
   version's record shows it trained on them, is printed and kept in the report
   (``evaluation.source``); a candidate that trained on them, or whose record cannot tell, is
   refused before anything changes (its figures would flatter it). If the candidate's AUC is
   lower by more than ``--margin``, it is **refused**: removed from the plan and unregistered;
   the default keeps all traffic, and the command exits 1. The default is scored first, before
   step 1: when it scores near chance itself (canary.py ``misfit``: AUC < 0.55 or NE > 1), the
   candidate passes step 3 only if it does not (a bad default must not block a better
   candidate: before, a default the gate had refused, served again after a restart, refused
   every candidate "because the data does not fit"); when neither fits, it is refused;
4. **shift** the requests that name no version in ``--steps`` (default 5% -> 50% -> 100%),
   ``--dwell-s`` at each, checking that the candidate stays ready and that its error ratio
   (the gateway's ``version_requests_total{model_version,code}``) exceeds the default's by at
   most ``--max-error-excess``, else it is **refused** as in 3 (serving/tools/canary.py). A
   step the gate cannot judge (fewer than ``--error-min-requests`` candidate requests, metrics
   off or unreachable) goes on past its dwell, ``--judge-timeout-s`` at most, then the
   candidate is refused: a step is never passed unjudged (``--steps 100``: no traffic step,
   hence no error gate, said so);
5. **promote**: the candidate becomes the plan's (and TorchServe's) default; the old default
   is recorded as ``previous``;
6. **keep** the old default loaded for ``--keep-previous-s`` (600 s; in the plan without
   traffic of its own, so calls naming it are still answered): a rollback meanwhile is one
   plan switch. TorchServe has no expiry: the first rollout command run after the grace (any
   ``make rollout``, with or without VERSION) takes it out of the plan, waits ``--drain-s``
   for calls already sent, and unregisters it on every replica. With 0, that happens here.

``--rollback`` does the same towards the plan's ``previous`` version (still loaded within its
grace, else registered again from the model store), without evaluation and in one step by
default: the known-good model comes back at once. A replica that restarts at any point loads
the plan's versions (TorchServe's ``config.properties`` is written from the plan), so replicas
never serve different sets.

A rollout interrupted half-way leaves a consistent plan (each step is one atomic write); run
the same command again to continue, or ``--rollback``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from recsys_stack.config import ConfigError, env_field, parse
from serving import plan as plan_io
from serving.gateway.auth import AuthError
from serving.gateway.config import ChannelConfig
from serving.plan import Plan, PlanError
from serving.tools import canary
from serving.tools import evaluate as ev
from serving.tools.channel import channel_fields
from serving.tools.evaldata import Window, file_window, model_window, provenance, refusal
from serving.tools.served import Gateway, RolloutError, Stack
from serving.tools.state import WORKDIR, WORKDIR_ENV
from serving.tools.versions import (
    register_everywhere,
    release_previous,
    say,
    settle_previous,
    withdraw,
    write,
)
from serving.torchserve import manage

logger = logging.getLogger("serving.tools.rollout")


@dataclass
class RolloutConfig(ChannelConfig):
    """Roll a model version out on the running stack, evaluated and step by step (or back).
    TLS and the token: as in every tool (``--tls-ca``, ``RECSYS_CLIENT_TLS_*``, ...), what is
    left empty comes from the running gateway's config (serving/tools/channel.py)."""

    version: str = ""
    """The version to roll out: ``<model>-<version>.mar`` in the model store (`make export
    VERSION=...`). Required unless ``rollback``."""
    rollback: bool = False
    """Return to the plan's ``previous`` version (no evaluation, ``rollback_steps``)."""
    workdir: Path = env_field(WORKDIR_ENV, WORKDIR)
    """The running stack's state folder (``make serve``'s)."""
    eval_data: Path | None = None
    """Labelled Criteo TSV to compare the candidate with the default on; default: the rows the
    candidate never trained on (its schema.json's ``data.unseen``: a batch run's held-out
    split, a continuous run's next file)."""
    holdout: float = 0.1
    """Evaluate the last fraction of ``eval_data``'s rows (0.1 = a training run's held-out
    split of the file it trained on); 0 = every row. Not used for the default rows."""
    eval_rows: int = 0
    """Evaluate at most this many rows (0 = all of the unseen rows or ``holdout``'s; the first
    ones)."""
    evaluate: bool = True
    """Compare the candidate with the default before it takes traffic (off: promote it
    without looking; ``rollback`` never evaluates)."""
    margin: float = 0.002
    """Refuse the candidate when its AUC is lower than the default's by more than this
    (negative: it must beat the default by at least that much)."""
    steps: list[int] = field(default_factory=lambda: [5, 50, 100])
    """Percent of the requests naming no version sent to the candidate, step by step (the
    error gate judges each step below 100; ``[100]``: none, so no error gate)."""
    max_error_excess: float = 0.01
    """Refuse the candidate when, in the traffic steps, its error ratio (non-OK requests /
    requests, the gateway's metrics) exceeds the default's by more than this (0.01: 1 point)."""
    error_min_requests: int = 20
    """Candidate requests in the traffic steps before its error ratio is judged (fewer: not
    judged, and a step not judged never lets the rollout go on: see ``judge_timeout_s``)."""
    judge_timeout_s: float = 300.0
    """Longest a traffic step goes on past ``dwell_s`` while the error gate cannot judge (too
    few candidate requests, metrics off or unreachable); then the candidate is refused."""
    rollback_steps: list[int] = field(default_factory=lambda: [100])
    """The steps of ``rollback``."""
    dwell_s: float = 10.0
    """Time at each traffic step before the next."""
    drain_s: float = 5.0
    """After the old version leaves the plan: time for calls already sent to it to finish
    before it is unregistered."""
    keep_previous_s: float = 600.0
    """After a promotion, the old default stays in the plan (no traffic of its own) with its
    workers loaded for this long, so ``rollback`` is one plan switch; the first rollout command
    run after that (``make rollout``, with or without VERSION) unregisters it. 0 = drain and
    unregister it at once."""
    timeout_s: float = 240.0
    """Longest wait for a replica to load a version, or for the gateway to apply a plan."""
    progress: bool = True
    """Progress bar while evaluating."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "rollback_steps"):
            steps = getattr(self, name)
            if not steps or steps[-1] != 100 or any(not 0 < s <= 100 for s in steps):
                raise ValueError(f"{name} = {steps}: percents in (0, 100] ending with 100")
            if steps != sorted(steps):
                raise ValueError(f"{name} = {steps}: must increase")
        for name in ("judge_timeout_s", "keep_previous_s", "dwell_s", "drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: a duration, >= 0")
        if self.error_min_requests < 0:
            raise ValueError(f"error_min_requests = {self.error_min_requests}: >= 0")


Judged = tuple[dict[str, Any], str]  # (schema.json, "<model> v<version>")


def eval_window(cfg: RolloutConfig, candidate: Judged) -> Window:
    """``--eval-data``'s rows, else the rows the candidate's schema records as unseen."""
    if cfg.eval_data is not None:
        return file_window(cfg.eval_data, cfg.holdout, cfg.eval_rows)
    try:
        return model_window(candidate[0], candidate[1], cfg.eval_rows)
    except ValueError as e:  # DataMismatch: no record, data missing or changed
        raise refusal(e, "--eval-data") from None


def schema_of(stack: Stack, model: str, version: str) -> Judged:
    """``(schema.json, "<model> v<version>")`` of a version in the store (an empty schema when
    its archive cannot be read: its record then tells nothing)."""
    try:
        schema = plan_io.read_mar_schema(stack.replicas[0].model_store / f"{model}-{version}.mar")
    except (PlanError, OSError, ValueError):
        schema = {}
    return schema, f"{model} v{version}"


def seen_rows(source: dict[str, Any]) -> str | None:
    """Why the evaluation rows cannot judge the candidate (it trained on them, or its record
    cannot tell), None when they can; ``source``: :func:`~.evaldata.provenance`'s record."""
    if source["unseen_by_candidate"]:
        return None
    return (
        f"({source['candidate_record']}): its figures on these rows would flatter it; evaluate "
        "on rows it never trained on (the default rows: its schema's unseen rows; re-export it "
        "if it records none) or pass EVAL_DATA=FILE.tsv (--eval-data) of other rows"
    )


def evaluate_version(
    cfg: RolloutConfig, stack: Stack, version: str, window: Window | None = None
) -> dict[str, Any]:
    """AUC, NE, log loss, calibration of ``version`` through the gateway on ``window``
    (default: :func:`eval_window` of ``version`` as the candidate)."""
    host, port = stack.target.rsplit(":", 1)
    ecfg = ev.EvaluateConfig(version=version, host=host, port=int(port), progress=cfg.progress,
                             **channel_fields(stack.channel))  # fmt: skip
    if window is None:
        window = eval_window(cfg, schema_of(stack, plan_io.load(stack.plan_file).model, version))
    y, p = ev.score_file(ecfg, window)
    return ev.metrics(y, p, ecfg.bins)


def step(
    plan: Plan, pct: int, ctx: tuple[RolloutConfig, Stack, Gateway, canary.ErrorGate]
) -> tuple[Plan, canary.Judgement]:
    """``pct`` % of the traffic to the candidate for ``dwell_s``, then on until the error gate
    judges, ``judge_timeout_s`` at most; returns the last judgement (only PASS goes on)."""
    cfg, stack, gw, gate = ctx
    old, target = gate.default, gate.candidate
    say(f"  v{target} takes {pct}% of the traffic for {cfg.dwell_s:g} s")
    traffic = {old: 100 - pct, target: pct}
    plan = write(plan.with_changes(traffic=traffic), stack, gw, cfg.timeout_s)
    t0, waiting = time.monotonic(), False
    while True:  # readiness and errors looked at every 0.5 s, at least once a step
        if not gw.ready(plan.model, target):
            plan = write(plan.with_changes(traffic={}), stack, gw, cfg.timeout_s)
            raise RolloutError(
                f"v{target} left rotation at {pct}%: all traffic back to v{old}; "
                f"`make rollout VERSION={target}` to retry or roll it out of the plan"
            )
        judged = gate.check(gw.outcomes())
        waited = time.monotonic() - t0
        if judged.verdict is canary.Verdict.FAIL or (
            waited >= cfg.dwell_s
            and (
                judged.verdict is canary.Verdict.PASS or waited >= cfg.dwell_s + cfg.judge_timeout_s
            )
        ):
            return plan, judged
        if waited >= cfg.dwell_s and not waiting:
            say(f"  {judged.seen}: waiting up to {cfg.judge_timeout_s:g} s more")
            waiting = True
        time.sleep(0.5)


def refuse(
    plan: Plan, why: str, report: dict[str, Any], cfg: RolloutConfig, stack: Stack, gw: Gateway
) -> dict[str, Any]:
    """The candidate out: all traffic back to the default, withdrawn, unregistered."""
    target, old = report["to"], report["from"]
    say(f"refused: v{target} {why}; v{old} keeps all traffic")
    report["reason"] = why
    plan = withdraw(plan, target, cfg, stack, gw)
    report["plan"] = plan.to_json()
    return report


def rollout(cfg: RolloutConfig) -> dict[str, Any]:
    """The whole procedure (module doc); returns the report (raises RolloutError when it
    stops; a refused candidate is a report with ``"promoted": False``). Without a version
    (and not ``rollback``): only release the previous default if its grace is over."""
    stack = Stack.find(cfg, cfg.workdir)
    plan = plan_io.load(stack.plan_file)
    old = plan.default
    if not cfg.version and not cfg.rollback:
        gw = Gateway(stack)
        try:
            if not plan.kept:
                say(f"nothing kept loaded besides v{old}: which version? --version")
            plan = release_previous(plan, cfg, stack, gw)
        finally:
            gw.close()
        return {"model": plan.model, "to": "", "promoted": False, "plan": plan.to_json()}
    target = plan.previous if cfg.rollback else cfg.version
    if not target:
        raise RolloutError("no previous version to roll back to")
    if target == old:
        raise RolloutError(f"{plan.model} v{target} is the default already")
    mar = f"{plan.model}-{target}.mar"
    store = stack.replicas[0].model_store
    cand_schema = plan_io.read_mar_schema(store / mar)
    name, version, entry = plan_io.version_from_schema(cand_schema, mar)
    if (name, version) != (plan.model, target):
        raise RolloutError(f"{store / mar} holds {name} v{version}, not {plan.model} v{target}")
    plan.with_changes(versions={**plan.versions, target: entry})  # same features? before any change
    evaluated = cfg.evaluate and not cfg.rollback
    report: dict[str, Any] = {"model": plan.model, "from": old, "to": target,
                              "rollback": cfg.rollback, "promoted": False}  # fmt: skip
    gw = Gateway(stack)
    t_start = time.monotonic()
    try:
        say(f"{'rollback' if cfg.rollback else 'rollout'} {plan.model}: v{old} -> v{target}")
        if old.isdigit() and target.isdigit() and int(target) < int(old) and not cfg.rollback:
            say(f"  (a version is its checkpoint's training step, not an order: v{target} was "
                f"exported {cand_schema.get('created_at', 'at an unrecorded time')})")  # fmt: skip
        if evaluated:  # the default first: figures on rows it does not fit would mean nothing
            models = {"candidate": (cand_schema, f"{plan.model} v{target}"),
                      "default": schema_of(stack, plan.model, old)}  # fmt: skip
            window = eval_window(cfg, models["candidate"])
            source = provenance(window, models)
            report["evaluation"] = {"rows": window.describe(), "source": source}
            say(f"evaluation rows: {window.describe()}")
            say(f"  unseen by the candidate v{target}: {_yes(source, 'candidate')}; "
                f"by the default v{old}: {_yes(source, 'default')}")  # fmt: skip
            if why := seen_rows(source):
                say(f"refused: v{target} (the candidate) {why}; nothing changed")
                return report
            base = evaluate_version(cfg, stack, old, window)
            report["evaluation"]["default"] = base
            if why := canary.misfit(base):  # the candidate must fit them itself, step 3
                say(f"v{old} (the default) {why.split(': the evaluation')[0]}: v{target} is "
                    "promoted only if it fits these rows itself")  # fmt: skip
        if not cfg.rollback and target != plan.kept:
            plan = release_previous(plan, cfg, stack, gw)
        say(f"[1/6] register {mar} on {len(stack.replicas)} replica(s)")
        plan = register_everywhere(plan, target, mar, stack, gw, cfg.timeout_s)
        if target in plan.versions:
            say(f"[2/6] v{target} is in the plan already (kept loaded)")
        else:
            say(f"[2/6] add v{target} to the plan (no traffic yet)")
            plan = write(plan.with_changes(versions={**plan.versions, target: entry}), stack, gw,
                         cfg.timeout_s)  # fmt: skip
        gw.wait(f"find v{target} ready", lambda: bool(gw.ready(plan.model, target)), cfg.timeout_s)
        if evaluated:
            say(f"[3/6] evaluate v{target} through the gateway against v{old}'s figures")
            cand = evaluate_version(cfg, stack, target, window)
            ok, table = canary.compare(base, cand, cfg.margin)
            say(table)
            report["evaluation"] |= {"candidate": cand, "margin": cfg.margin}
            if not ok:
                return refuse(plan, "is withdrawn", report, cfg, stack, gw)
        else:
            say("[3/6] evaluation skipped" + (" (rollback)" if cfg.rollback else ""))
        steps = cfg.rollback_steps if cfg.rollback else cfg.steps
        # judged before the promotion: every step below 100 % (``--steps 100`` asks for no
        # canary window, as --no-evaluate for no evaluation: said so, not a judgement)
        judged = steps[:-1]
        gate = canary.ErrorGate(old, target, cfg.max_error_excess, cfg.error_min_requests,
                                gw.outcomes())  # fmt: skip
        say(f"[4/6] shift the traffic: {' -> '.join(f'{p}%' for p in steps)}"
            + ("" if judged else " (at once: no traffic step, no error gate)"))  # fmt: skip
        for pct in judged:
            plan, seen = step(plan, pct, (cfg, stack, gw, gate))
            report["error_gate"] = seen.seen
            if seen.verdict is canary.Verdict.FAIL:
                say(f"error gate: {seen.seen}")
                return refuse(plan, "is withdrawn", report, cfg, stack, gw)
            if seen.verdict is canary.Verdict.NOT_JUDGED:
                limit = cfg.dwell_s + cfg.judge_timeout_s
                why = f"could not be judged in {limit:g} s at {pct}% ({seen.seen})"
                return refuse(plan, f"is withdrawn: it {why}", report, cfg, stack, gw)
            say(f"  {seen.seen}")
        say(f"[5/6] promote v{target} to default (previous: v{old})")
        for ts in stack.replicas:
            manage.set_default(ts, plan.model, target)
        plan = write(
            plan.with_changes(default=target, previous=old, traffic={}), stack, gw, cfg.timeout_s
        )
        report["promoted"] = True
        plan = settle_previous(plan, cfg, stack, gw)
        report["plan"] = plan.to_json()
    finally:
        gw.close()
        report["seconds"] = round(time.monotonic() - t_start, 1)
    say(f"done in {report['seconds']} s: {plan.model} v{target} serves all traffic")
    return report


def _yes(source: dict[str, Any], role: str) -> str:
    """``yes (why)`` / ``no (why)`` / ``cannot tell (why)`` of :func:`~.evaldata.provenance`."""
    answer = {True: "yes", False: "no", None: "cannot tell"}[source[f"unseen_by_{role}"]]
    return f"{answer} ({source[f'{role}_record']})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 promoted, 1 refused or stopped (the plan stays consistent), 2 bad use."""
    try:
        cfg = parse(
            RolloutConfig, argv, "python -m serving.tools.rollout", __doc__.split("\n\n")[0]
        )
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        report = rollout(cfg)
    except (RolloutError, PlanError, manage.ManageError, AuthError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"error: the gateway: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    if not report["to"]:  # only released (or kept) the previous default: nothing rolled out
        return 0
    out = cfg.workdir / "rollouts" / f"{time.strftime('%Y%m%d-%H%M%S')}-v{report['to']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"report: {out}")
    return 0 if report["promoted"] else 1


if __name__ == "__main__":
    sys.exit(main())
