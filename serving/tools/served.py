"""The running stack as ``make rollout`` works on it: :class:`Stack` (what ``make serve``
recorded: replicas, gateway, plan file, how to reach it) and :class:`Gateway` (what the rollout
asks the gateway: a version's readiness over KServe v2, its metrics when exposed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from serving.gateway.config import ChannelConfig, GatewayConfig
from serving.gateway.metrics_http import read_tokens as read_metrics_tokens
from serving.plan import Plan
from serving.stubs import kserve_pb2, kserve_pb2_grpc
from serving.tools import canary
from serving.tools.channel import for_gateway, metadata, open_channel
from serving.tools.state import gateway_config, local_target, read_state, replicas
from serving.torchserve.config import TorchServeConfig


class RolloutError(RuntimeError):
    """The rollout stopped; the message says where and what the plan is now."""


@dataclass
class Stack:
    """The running stack as ``make serve`` recorded it."""

    replicas: list[TorchServeConfig]
    gateway: GatewayConfig
    plan_file: Path
    channel: ChannelConfig

    @classmethod
    def find(cls, cfg: ChannelConfig, workdir: Path) -> Stack:
        """What ``make serve`` recorded in ``workdir``, reached with ``cfg``'s channel."""
        state = read_state(workdir)
        gw = gateway_config(workdir)
        reps = replicas(workdir)
        if gw is None or not reps or not state.get("plan"):
            raise RolloutError(f"nothing is serving from {workdir} (start it with `make serve`)")
        return cls(reps, gw, Path(state["plan"]), for_gateway(cfg, gw))

    @property
    def target(self) -> str:
        return local_target(self.gateway)


class Gateway:
    """What the rollout asks the gateway (KServe v2 calls, and its metrics when exposed)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.channel = open_channel(stack.target, stack.channel)
        self.stub = kserve_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = metadata(stack.channel)

    def close(self) -> None:
        self.channel.close()

    def ready(self, model: str, version: str) -> bool | None:
        """True/False: the gateway routes ``version`` (ready or not); None: not in its plan."""
        try:
            reply = self.stub.ModelReady(
                kserve_pb2.ModelReadyRequest(name=model, version=version),
                metadata=self.metadata, timeout=5,
            )  # fmt: skip
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                return None
            raise
        return bool(reply.ready)

    def metrics(self) -> str | None:
        """The gateway's ``/metrics`` text (None: its metrics are off or do not answer)."""
        m = self.stack.gateway.metrics
        if not m.port:
            return None
        host = "127.0.0.1" if (m.host or self.stack.gateway.host) in ("", "0.0.0.0") else m.host
        try:  # the endpoint's token, when it has one (serving/gateway/metrics_http.py)
            token = read_metrics_tokens(m.token_file)[0] if m.token_file else ""
        except ValueError:
            return None  # unreadable here: as good as metrics that do not answer
        return canary.scrape(f"http://{host or '127.0.0.1'}:{m.port}/metrics", token=token)

    def generation(self) -> int | None:
        """The generation of this stack's plan file the gateway applied (None: its metrics are
        off, or the metrics port answers for another gateway, whose plan file differs)."""
        text = self.metrics()
        return None if text is None else canary.plan_generation(text, self.stack.plan_file)

    def outcomes(self) -> canary.Outcomes | None:
        """Requests and errors per version so far (None: metrics off)."""
        text = self.metrics()
        return None if text is None else canary.outcomes(text)

    def wait(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        t0 = time.monotonic()
        while not done():
            if time.monotonic() - t0 > timeout:
                raise RolloutError(f"the gateway did not {what} within {timeout:.0f} s")
            time.sleep(0.2)

    def applied(self, plan: Plan, timeout: float) -> None:
        """Until the gateway runs ``plan`` (its generation in the metrics, or two health
        intervals when metrics are off)."""
        if self.generation() is None:
            time.sleep(2.5 * self.stack.gateway.health_interval_s)
            return
        self.wait(
            f"apply plan {plan.generation}",
            lambda: (self.generation() or -1) >= plan.generation,
            timeout,
        )
