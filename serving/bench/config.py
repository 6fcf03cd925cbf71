"""The serving benchmark's config: what to measure, on which model, against which stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from serving.gateway.config import GatewayConfig
from serving.torchserve.config import MODEL_STORE, TorchServeConfig

# fmt: off
Method = Literal["in-process", "plain-torchserve", "torchserve-grpc", "relay", "gateway",
                 "gateway-lite", "gateway-lite-grpc", "gateway+log"]
METHODS: list[Method] = ["in-process", "plain-torchserve", "torchserve-grpc", "relay", "gateway",
                         "gateway-lite"]
# fmt: on
LITE: Method = "gateway-lite"  # the gateway in front of serving/lite workers, not TorchServe
LITE_GRPC: Method = "gateway-lite-grpc"  # the same workers reached over gRPC, not their sockets
LITES = (LITE, LITE_GRPC)
LOGGED: Method = "gateway+log"  # the gateway with its feature log on (--feature-log)
BASELINE: Method = "plain-torchserve"
FLOOR: Method = "in-process"


@dataclass
class BenchConfig:
    """Serving benchmark: in-process vs plain TorchServe vs TorchServe gRPC vs a bare relay in
    front of it (serving/bench/relay.py: the cost of the hop alone) vs the gateway."""

    export: Path | None = None
    """An export dir whose .mar is in model_store (default: train and export a model to bench)."""
    model_store: Path = MODEL_STORE
    """Folder holding the export's ``<name>-<version>.mar`` (with --export)."""
    max_rows: int = 100_000
    """Table row cap of the criteo-kaggle-shaped model built when no export is given."""
    sizes: list[int] = field(default_factory=lambda: [1, 100, 1000])
    """Examples per request, one set of cells each."""
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    """Client threads (closed loop, one connection each); in-process runs at 1 only."""
    requests: int = 200
    """Requests per cell and round, split over the client threads (at least 2 each)."""
    rounds: int = 2
    """Rounds; within each, every cell runs every method in turn, so noise hits all alike (in
    reverse order on odd rounds, so no method always runs second)."""
    warmup: int = 16
    """Untimed requests per method and size before the first round (TorchScript's profiling
    runs, every TorchServe worker reached)."""
    warmup_s: float = 10.0
    """Then seconds of untimed load per method (in-process aside), every size in turn: the
    stack's throughput climbs ~50% over its first ~5,000 requests (relay, 100 examples x 4:
    21.9k -> 34.2k examples/s over six rounds of 1,000), so without it the stack warms during
    the timed cells and the order of the methods within a round skews their ratios. 0 = off."""
    methods: list[Method] = field(default_factory=lambda: list(METHODS))
    """Methods to run (ratios need plain-torchserve; efficiency needs in-process)."""
    feature_log: bool = False
    """Also run ``gateway+log``: a second gateway in front of the same TorchServe with its
    feature log on (every example logged, serving/gateway/featurelog.py), interleaved with
    ``gateway`` cell by cell: the log's cost, side by side."""
    json: Path | None = None
    """Also write the results and settings here."""
    plain_threads: int = 1
    """``OMP_NUM_THREADS`` of the peer's workers (its handler, like TorchServe's examples, never
    sets torch's threads); 0 = unset: torch's default, every core in each of TorchServe's
    default workers (= cores), which oversubscribes the cores and collapses under concurrency.
    The benchmark's only change to TorchServe's defaults: it measures the stronger peer."""
    startup_timeout_s: float = 300.0
    """Longest wait for the TorchServe instances and the gateway to be ready."""
    torchserve: TorchServeConfig = field(default_factory=TorchServeConfig)
    """The stack's TorchServe (torchserve-grpc, gateway): workers, batch size and delay as
    ``make serve`` reads them; ports, model, store and workdir are set by the benchmark."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway (as ``make serve`` starts it); port, schema, backend and key_file are set by
    the benchmark."""

    def __post_init__(self) -> None:
        for name in ("sizes", "concurrency"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name}: give one or more positive numbers")
        if self.requests < 1 or self.rounds < 1 or min(self.warmup, self.plain_threads) < 0:
            raise ValueError("requests and rounds must be at least 1; warmup, plain_threads >= 0")
        if self.warmup_s < 0:
            raise ValueError("warmup_s must be >= 0")
        if not self.methods:
            raise ValueError("methods: name at least one of " + ", ".join(METHODS))
