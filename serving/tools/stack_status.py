"""``make status``: what the stack started by ``make serve`` is doing now (each replica's
versions and READY workers, the gateway's health, the plan)."""

from __future__ import annotations

from pathlib import Path

from serving import plan as plan_io
from serving.gateway.auth import AuthError
from serving.gateway.config import ChannelConfig
from serving.tools.channel import for_gateway
from serving.tools.client import health
from serving.tools.recorded import replica_name, survey
from serving.tools.state import gateway_config, local_target, read_state, replicas
from serving.torchserve import manage
from serving.torchserve.config import TorchServeConfig


def status(workdir: Path, client: ChannelConfig | None = None) -> tuple[int, str]:
    """``(exit code, report)``: 0 serving, 2 degraded, 3 not running (``client``: how to reach
    the gateway, completed from its recorded config). ``make status`` turns 3 into 0: nothing
    running is an answer there, not a failure."""
    alive, notes = survey(workdir)
    if not alive:
        return 3, "\n".join([*notes, f"not running ({workdir})"])
    lines, ok = list(notes), not notes
    for i, ts in enumerate(replicas(workdir)):
        versions = _versions(ts) if replica_name(i) in alive else {}
        ok &= bool(versions) and all(versions.values())
        shown = (
            ", ".join(f"v{v}: {n} READY workers" for v, n in versions.items()) or "0 READY workers"
        )
        lines.append(f"{replica_name(i)} {ts.grpc_inference_target} {ts.model_name}: {shown}")
    gw = gateway_config(workdir)
    if gw is not None:
        target = local_target(gw)
        answer = ("STOPPED", "")
        try:
            if "gateway" in alive:
                answer = health(target, channel=for_gateway(client or ChannelConfig(), gw))
        except AuthError as e:  # a TLS or token file it cannot read
            answer = ("UNREACHABLE", str(e))
        ok &= answer[0] == "SERVING"
        lines.append(f"gateway {target}: {answer[0]}" + (f" ({answer[1]})" if answer[1] else ""))
    state = read_state(workdir)
    if state.get("plan"):
        try:
            p = plan_io.load(Path(state["plan"]))
            lines.append(
                f"plan {p.generation}: default v{p.default}, traffic "
                f"{p.traffic or {p.default: 100}}, previous {p.previous or '-'}"
                + (" (kept loaded for rollback)" if p.kept else "")
            )
        except plan_io.PlanError as e:
            lines.append(str(e))
    return (0 if ok else 2), "\n".join(lines)


def _versions(ts: TorchServeConfig) -> dict[str, int]:
    """READY workers per registered version (empty when TorchServe does not answer)."""
    try:
        return manage.versions(ts, ts.model_name)
    except manage.ManageError:
        return {}
