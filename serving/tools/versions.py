"""The versions a rollout loads, keeps and unloads on every replica of the running stack:
registration one cordoned replica at a time, withdrawal (out of the plan, drained, unregistered),
and the previous default kept loaded for ``keep_previous_s`` so a rollback is one plan switch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from serving import plan as plan_io
from serving.plan import Plan
from serving.tools import state
from serving.tools.served import Gateway, Stack
from serving.torchserve import manage


class Timing(Protocol):
    """What these steps read of the rollout's config (serving.tools.rollout.RolloutConfig)."""

    timeout_s: float
    drain_s: float
    keep_previous_s: float
    workdir: Path


def say(text: str) -> None:
    print(text, flush=True)


def write(plan: Plan, stack: Stack, gateway: Gateway, timeout: float) -> Plan:
    plan_io.save(plan, stack.plan_file)
    gateway.applied(plan, timeout)
    return plan


def register_everywhere(
    plan: Plan, version: str, mar: str, stack: Stack, gw: Gateway, timeout: float
) -> Plan:
    """Register on one replica after the other, each cordoned while it loads and warms the
    version (the gateway sends its calls to the others, whose CPU is not busy loading)."""
    try:
        for ts in stack.replicas:
            t0 = time.monotonic()
            if manage.versions(ts, plan.model).get(version, 0) > 0:
                say(f"  {ts.grpc_inference_target}: {plan.model} v{version} READY already (loaded)")
                continue
            if len(stack.replicas) > 1:
                cordon = (ts.grpc_inference_target,)
                plan = write(plan.with_changes(cordon=cordon), stack, gw, timeout)
            manage.register(ts, plan.model, version, mar, timeout)
            manage.wait_ready(ts, plan.model, version, timeout)
            took = time.monotonic() - t0
            say(f"  {ts.grpc_inference_target}: {plan.model} v{version} READY ({took:.1f} s)")
    finally:  # a failed registration leaves no replica cordoned
        if plan.cordon:
            plan = write(plan.with_changes(cordon=()), stack, gw, timeout)
    return plan


def unregister_everywhere(stack: Stack, model: str, version: str) -> None:
    for ts in stack.replicas:
        manage.unregister(ts, model, version)
        say(f"  {ts.grpc_inference_target}: {model} v{version} unregistered")


def withdraw(plan: Plan, version: str, cfg: Timing, stack: Stack, gw: Gateway) -> Plan:
    """Take a non-default ``version`` out of the plan, let its calls finish, unregister it."""
    versions = {v: e for v, e in plan.versions.items() if v != version}
    traffic = {v: p for v, p in plan.traffic.items() if v != version}
    traffic = {} if not traffic or set(traffic) == {plan.default} else traffic
    plan = write(plan.with_changes(versions=versions, traffic=traffic), stack, gw, cfg.timeout_s)
    gw.wait(
        f"stop routing v{version}", lambda: gw.ready(plan.model, version) is None, cfg.timeout_s
    )
    time.sleep(cfg.drain_s)
    unregister_everywhere(stack, plan.model, version)
    return plan


def release_previous(plan: Plan, cfg: Timing, stack: Stack, gw: Gateway) -> Plan:
    """Withdraw and unregister the kept previous default once ``keep_previous_s`` has passed
    since its rollout kept it (TorchServe has no expiry of its own: rollout commands do this);
    one kept with no record of when is released at once."""
    if not (kept := plan.kept):
        return plan
    since = state.kept_since(cfg.workdir, kept)
    left = 0.0 if since is None else since + cfg.keep_previous_s - time.time()
    if left > 0:
        say(f"v{kept} (previous) stays loaded for rollback: {left:.0f} s of its grace left")
        return plan
    say(f"release v{kept} (previous): its grace of {cfg.keep_previous_s:g} s is over")
    plan = withdraw(plan, kept, cfg, stack, gw)
    state.record_kept(cfg.workdir, None)
    return plan


def settle_previous(plan: Plan, cfg: Timing, stack: Stack, gw: Gateway) -> Plan:
    """After a promotion: keep the old default loaded for ``keep_previous_s`` (in the plan, no
    traffic of its own), or drain and unregister it; any other version is withdrawn (the one
    kept before this rollout, a candidate an interrupted rollout left)."""
    keep = plan.previous if cfg.keep_previous_s > 0 else ""
    for v in [v for v in plan.versions if v not in (plan.default, keep)]:
        say(f"[6/6] drain v{v} ({cfg.drain_s:g} s) and unregister it")
        plan = withdraw(plan, v, cfg, stack, gw)
    if keep:
        say(f"[6/6] keep v{keep} loaded for {cfg.keep_previous_s:g} s (`make rollback` in one "
            "plan switch); the first `make rollout` after that unregisters it")  # fmt: skip
    state.record_kept(cfg.workdir, keep or None)
    return plan
