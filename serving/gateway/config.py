"""Configs of the gateway and its clients: the one place naming their ports and variables.

Both go through :mod:`recsys_stack.config` (defaults < ``--config FILE.toml`` < environment <
flags and ``section.key=value``); ``--help`` is generated from the docstrings below. Variables
are read when a config is loaded, never at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from recsys_stack.config import env_field
from recsys_stack.logpump import LogConfig
from serving.gateway.discovery import Discovery
from serving.gateway.featurelog_config import FeatureLogConfig
from serving.gateway.validate import Limits

GATEWAY_PORT_ENV = "RECSYS_GATEWAY_PORT"
GATEWAY_PORT = 50051
HTTP_PORT_ENV = "RECSYS_GATEWAY_HTTP_PORT"
HTTP_PORT = 8000  # Triton's and KServe's HTTP port
TOKEN_FILE_ENV = "RECSYS_GATEWAY_TOKEN_FILE"
TOKEN_FILE_NAME = "gateway_token"  # in the supervisor's workdir (runs/serve by default)
METRICS_PORT = 9464  # the OpenTelemetry Prometheus exporter's customary port


@dataclass
class CoalesceConfig:
    """How the gateway merges concurrent requests into TorchServe calls (serving/gateway/coalesce.py)."""

    enabled: bool = True
    """Merge requests that arrive while every backend slot is busy into one call."""
    max_examples: int = 2048
    """Most examples in one merged TorchServe call (a larger single request goes alone)."""
    calls_per_worker: int = 1
    """Backend calls in flight per TorchServe worker of the replicas in rotation (their
    workers as each replica's handler counts them in its describe answer); more requests queue
    here and leave merged as one call when a call ends (or on deck, below). 2 keeps a call
    waiting in TorchServe's queue for each worker, so none waits out the round trip to the
    gateway (the machine 93-96% busy at 100 examples x 4 callers against 83-86% with 1), but
    merges half as much: on the 2-core machine it gained nothing in the serving bench and lost
    7-14% of the demo's load test (docs/bench.md)."""
    merged_on_deck: bool = True
    """Also let merged calls (two or more queued requests) wait in TorchServe's queue, one per
    slot above, so a worker that finishes a call starts the next at once instead of waiting
    out the round trip to the gateway; a lone request still goes only to a free slot."""
    calls_per_backend: int = 0
    """Backend calls in flight per replica, whatever its workers; 0 = ``calls_per_worker`` x
    its workers."""
    alone_examples: int = 512
    """A request of at least this many examples neither waits for a slot nor is merged: it is
    work enough for a call of its own (merging it saves no per-call cost, only copies), and
    queueing it would leave TorchServe's workers idle between calls. 0 = every request may
    queue."""

    def __post_init__(self) -> None:
        if min(self.max_examples, self.calls_per_worker) < 1:
            raise ValueError("coalesce.max_examples and coalesce.calls_per_worker must be >= 1")
        if self.calls_per_backend < 0:
            raise ValueError("coalesce.calls_per_backend must be >= 0 (0: per worker)")
        if self.alone_examples < 0:
            raise ValueError("coalesce.alone_examples must be >= 0 (0: off)")


@dataclass
class HedgeConfig:
    """Hedged backend calls (serving/gateway/hedge.py): scoring has no side effects, so a call
    a replica has not answered by the backends' recent tail is sent to another as well."""

    ratio: float = 0.05
    """Most hedges per backend call, over time (a budget that earns this much per call): a
    stalled replica costs a few percent more calls, never twice the load. 0 = no hedging."""
    quantile: float = 0.95
    """Hedge a call that has not answered after ``factor`` x this quantile of recent call
    latencies..."""
    factor: float = 2.0
    """...(the healthy tail seldom reaches twice the p95: the budget stays for stalls)..."""
    min_ms: float = 20.0
    """...and never before this many milliseconds."""

    def __post_init__(self) -> None:
        if not (0 <= self.ratio <= 1 and 0 < self.quantile < 1 and self.factor >= 1):
            raise ValueError("hedge: ratio in [0, 1], quantile in (0, 1), factor >= 1")
        if self.min_ms < 0:
            raise ValueError("hedge: min_ms >= 0")


@dataclass
class AuthConfig:
    """Bearer tokens on every gateway service (serving/gateway/auth.py)."""

    token_file: str = env_field(TOKEN_FILE_ENV, "")
    """File of accepted tokens, one per line (``#`` comments and blank lines ignored), re-read
    when it changes; calls must carry ``authorization: Bearer <token>``. A file emptied,
    deleted or unparsable while serving accepts no token (fail closed). Empty = no
    authentication (refused on a non-loopback host unless ``allow_unauthenticated``)."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback host without a token file (anyone reaching the port can score)."""
    protect_health: bool = False
    """Require a token for ``grpc.health.v1`` too (off: probes need no secret). Reflection
    always requires one when a token file is set (it describes the services)."""
    unauthenticated_rate: float = 10.0
    """Calls without an accepted token each peer address may make per second (a token bucket
    of ``unauthenticated_burst``), each refused at once with UNAUTHENTICATED; past it they are
    refused with RESOURCE_EXHAUSTED after ``unauthenticated_delay_s``."""
    unauthenticated_burst: float = 20.0
    """The bucket's size: refusals a peer may get at once before the rate applies."""
    unauthenticated_delay_s: float = 1.0
    """How long a refusal past the peer's bucket waits before it is answered (a client that
    loops on refusals then makes one call per loop per this many seconds); 0 = no wait."""

    def __post_init__(self) -> None:
        if min(self.unauthenticated_rate, self.unauthenticated_burst - 1) < 0:
            raise ValueError("auth.unauthenticated_rate must be >= 0 and _burst >= 1")
        if not 0 <= self.unauthenticated_delay_s <= 60:
            raise ValueError("auth.unauthenticated_delay_s must be in [0, 60]")


@dataclass
class TlsConfig:
    """TLS on the gateway's port; all empty = plaintext."""

    cert: str = env_field("RECSYS_GATEWAY_TLS_CERT", "")
    """Server certificate chain (PEM); with ``key``, turns TLS on."""
    key: str = env_field("RECSYS_GATEWAY_TLS_KEY", "")
    """Private key of ``cert`` (PEM)."""
    client_ca: str = env_field("RECSYS_GATEWAY_TLS_CLIENT_CA", "")
    """CA bundle (PEM) that client certificates must chain to: mutual TLS, a client without
    one is refused during the handshake. Empty = server-side TLS only."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key) or (self.client_ca and not self.cert):
            raise ValueError("tls: set cert and key together (client_ca needs them too)")


@dataclass
class MetricsConfig:
    """The gateway's Prometheus endpoint (serving/gateway/metrics.py)."""

    port: int = env_field("RECSYS_GATEWAY_METRICS_PORT", METRICS_PORT)
    """Port of ``GET /metrics`` (Prometheus text format); 0 = no endpoint. A port already in
    use is logged as an error and the gateway serves without the endpoint."""
    host: str = env_field("RECSYS_GATEWAY_METRICS_HOST", "127.0.0.1")
    """Bind address of the endpoint: loopback unless exposed on purpose (0.0.0.0 or the pod's
    address where Prometheus scrapes from another container); empty = the gateway's ``host``."""
    token_file: str = env_field("RECSYS_GATEWAY_METRICS_TOKEN_FILE", "")
    """File holding the bearer token scrapes must send (``Authorization: Bearer <token>``,
    else 401; Prometheus: ``authorization: {credentials_file: FILE}``): its content, blank
    lines and ``#`` lines aside (one token per line), re-read when it changes; an emptied or
    unreadable file refuses every scrape. Empty = no token."""
    cache_s: float = 1.0
    """A rendering of the metrics is served for this long: one render per interval however
    many scrape (each render holds the GIL the scoring path needs). 0 = render every scrape."""


@dataclass
class GatewayLogConfig(LogConfig):
    """Where the gateway's log goes: its stdout and stderr (Python logging and grpc-core's C++
    lines alike) through a pump that rate-limits each kind of line and rotates the file."""

    file: str = env_field("RECSYS_GATEWAY_LOG_FILE", "")
    """Log file (rotated by size); empty = stderr (a container's log), still rate-limited.
    ``make serve`` sets ``<workdir>/gateway.log``."""


@dataclass
class ConnectionsConfig:
    """Connections are a resource too (serving/gateway/connections.py): idle ones closed, a
    silent one dropped after its handshake time, caps in total (and per peer over HTTP) below
    the open-files limit, so accept() never meets EMFILE. 0 = off, for each key."""

    grpc_idle_s: float = 30.0
    """Close a gRPC connection without a call for this long (GOAWAY: a client reconnects on
    its next call, one handshake). Below the idle timeouts of the middleboxes in common use
    (AWS ALB 60 s, NLB 350 s, Azure LB 4 min), so the gateway closes first and cleanly instead
    of a client's next call meeting a connection a middlebox dropped silently."""
    grpc_max_age_s: float = 600.0
    """Close every gRPC connection after this long (grpc adds +-10% jitter), so clients resolve
    the name again and a scale-out or a rolling update gets its share of the connections."""
    grpc_age_grace_s: float = 30.0
    """Calls in flight on a connection closed for age may finish within this (our longest
    call: a 2 s backend deadline + 0.25 s per MB of a 13.5 MB body); 0 = without end."""
    grpc_max_connections: int = 4096
    """Open gRPC connections at most (``grpc.max_allowed_incoming_connections``); one more is
    closed as it is accepted. Counted from accept, handshakes included. There is no per-peer
    cap on gRPC: grpc Python has no accept hook (firewall ``connlimit`` or a proxy does that)."""
    grpc_max_streams: int = 256
    """Calls at once on one gRPC connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a client
    past it queues on its side. Above the concurrency of any one caller we run (the load
    test's users each have their own channel; the suite's most on one channel is 40)."""
    handshake_timeout_s: float = 10.0
    """A connection that has not finished its handshake (TLS, HTTP/2 preface and SETTINGS on
    gRPC; TLS on HTTP) within this is closed: grpc's default, 120 s, let a silent or
    plaintext connection to the TLS port hold a descriptor for two minutes. A datacenter
    client needs milliseconds. (A plaintext HTTP connection's head is bounded by
    ``limits.read_timeout_s``.)"""
    http_max_connections: int = 2048
    """Open KServe HTTP connections at most; one more is closed as it is accepted (before any
    TLS work). HTTP/1.1 carries one call at a time per connection: a caller's connections are
    its concurrency."""
    http_max_per_peer: int = 256
    """Open KServe HTTP connections from one IP address at most. Behind a load balancer or NAT
    that shows many clients as one address, set 0 (off) or ``http_max_connections``."""

    def __post_init__(self) -> None:
        if min(self.grpc_idle_s, self.grpc_max_age_s, self.grpc_age_grace_s) < 0:
            raise ValueError("connections: grpc_idle_s, grpc_max_age_s, grpc_age_grace_s >= 0")
        if self.handshake_timeout_s < 0:
            raise ValueError("connections.handshake_timeout_s must be >= 0 (0: grpc's 120 s)")
        caps = (self.grpc_max_connections, self.grpc_max_streams, self.http_max_connections,
                self.http_max_per_peer)  # fmt: skip
        if min(caps) < 0:
            raise ValueError("connections: the caps (max_*) must be >= 0 (0: off)")


@dataclass
class GatewayConfig:
    """The gRPC gateway in front of one or more TorchServe replicas."""

    schema: Path = Path("runs/demo/export/schema.json")
    """The exported model's schema.json: the request contract (feature names and order) and
    model name every version shares; its version is the one served when ``plan`` is empty."""
    plan: str = env_field("RECSYS_SERVING_PLAN", "")
    """Serving plan file (serving/plan.py: versions, default, traffic shares), re-read when it
    changes; written by ``make serve``, ``make rollout`` and ``make rollback``. Empty = the one
    version of ``schema``."""
    host: str = env_field("RECSYS_GATEWAY_HOST", "127.0.0.1")
    """Bind address (0.0.0.0 to serve other hosts, as in a container)."""
    port: int = env_field(GATEWAY_PORT_ENV, GATEWAY_PORT)
    """Port of the ``recsys.v1.Ranker`` and ``grpc.health.v1`` services; 0 = any free port."""
    http_port: int = env_field(HTTP_PORT_ENV, HTTP_PORT)
    """Port of KServe v2 over HTTP/JSON (``/v2/...``, serving/gateway/rest.py) on ``host``,
    with the same auth, TLS, limits and metrics as gRPC; 0 = any free port (logged), -1 = off.
    A port already in use is logged as an error and the gateway serves gRPC only."""
    backend: str = env_field("RECSYS_TS_GRPC", "127.0.0.1:7070")
    """TorchServe gRPC inference replicas, comma-separated: ``host:port``, or
    ``dns:///name:port`` for every address the name resolves to, looked up again at each
    health round (replicas a Deployment or ``--scale`` adds join, removed ones drain;
    serving/gateway/discovery.py), or ``lite:PATH`` for a lite worker's socket on this
    machine (``python -m serving.lite`` prints them). Round robin over the healthy ones,
    failover on an outage."""
    key_file: str = env_field("RECSYS_TS_KEY_FILE", "runs/serve/torchserve/key_file.json")
    """TorchServe's key_file.json: one for all replicas, one per ``backend`` entry
    (comma-separated), or a template naming ``{host}`` such as ``/keys/{host}.json`` (each
    replica's own, by its address). The inference key goes in each call's metadata and is
    re-read when the file changes."""
    deadline_s: float = 2.0
    """Deadline of each call to TorchServe; a backend that misses it is out of rotation."""
    deadline_per_mb_s: float = 0.25
    """Added to deadline_s per MB of a call's body (the largest request allowed is a ~13.5 MB
    body: 2 + 3.4 s), so that a large call on a busy machine is not taken for an outage."""
    backend_max_bytes: int = 16 * 1024 * 1024
    """Largest body TorchServe accepts (its ``max_request_size``, ``[torchserve]
    max_request_bytes``): merged calls stay under it, and the largest request the limits allow
    must fit in it (checked at start)."""
    health_interval_s: float = 1.0
    """How often every backend is probed with a one-example request (health and rotation)."""
    grace_s: float = 5.0
    """On SIGTERM: how long in-flight calls may finish."""
    limits: Limits = field(default_factory=Limits)
    """What one request may carry (larger ones are INVALID_ARGUMENT)."""
    coalesce: CoalesceConfig = field(default_factory=CoalesceConfig)
    """Adaptive merging of concurrent requests into TorchServe calls."""
    hedge: HedgeConfig = field(default_factory=HedgeConfig)
    """A second copy of a call that its replica is slow to answer, within a budget."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Who may call (bearer tokens); health open by default."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """TLS and mutual TLS on the gateway's port."""
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    """Idle and silent connections closed, caps below the open-files limit."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus metrics endpoint."""
    feature_log: FeatureLogConfig = field(default_factory=FeatureLogConfig)
    """The closed loop's log of what was scored, and ``Feedback`` clicks (off by default)."""
    log_level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """DEBUG also logs every TorchServe call with its request and example counts, and turns
    the log's rate limit off (``log.per_kind``)."""
    log: GatewayLogConfig = field(default_factory=GatewayLogConfig)
    """The log file, its rotation and its rate limit."""

    def __post_init__(self) -> None:
        if self.http_port < -1:
            raise ValueError("http_port: a port, 0 (any free port) or -1 (off)")
        Discovery(self.backend, self.key_file)  # ValueError naming a bad entry or key file


@dataclass
class ChannelConfig:
    """How our own tools reach the gateway: TLS and the bearer token (serving/tools/channel.py).

    The client, evaluation, rollout, the supervisor's wait and ``status``, the container
    healthcheck and the load test all read these, with the same variables."""

    token_file: str = env_field(TOKEN_FILE_ENV, "")
    """The gateway's token file (its first token is sent as ``authorization: Bearer``); empty =
    ``$RECSYS_SERVE_DIR/gateway_token`` (default ``runs/serve/gateway_token``, written by ``make
    serve``) when it exists, else no token."""
    tls_ca: str = env_field("RECSYS_CLIENT_TLS_CA", "")
    """CA certificates (PEM; several files comma-separated) to verify a TLS gateway with; setting
    it turns TLS on. Empty with ``tls`` = the system's roots."""
    tls_cert: str = env_field("RECSYS_CLIENT_TLS_CERT", "")
    """Client certificate chain (PEM) for a gateway with mutual TLS; needs ``tls_key``."""
    tls_key: str = env_field("RECSYS_CLIENT_TLS_KEY", "")
    """Private key of ``tls_cert`` (PEM)."""
    tls_server_name: str = env_field("RECSYS_CLIENT_TLS_SERVER_NAME", "")
    """Name the gateway's certificate must carry when it differs from the host dialled (e.g.
    ``gateway`` while dialling 127.0.0.1); empty = the host dialled."""
    tls: bool = env_field("RECSYS_CLIENT_TLS", False)
    """TLS even without ``tls_ca`` / ``tls_cert`` (the gateway's certificate is then verified
    against the system's roots). Off with all of them empty = plaintext."""

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together (mutual TLS needs both)")


@dataclass
class ClientConfig(ChannelConfig):
    """Score Criteo TSV rows through the gateway."""

    data: Path | None = None
    """Criteo TSV to score (label column optional); default: the rows the served model never
    trained on (its schema.json's ``data.unseen``; the stack of ``workdir``)."""
    rows: int = 10
    """Rows to score, from the top of the file (or of the unseen rows)."""
    batch: int = 100
    """Examples per request."""
    host: str = "127.0.0.1"
    """The gateway's host."""
    port: int = env_field(GATEWAY_PORT_ENV, GATEWAY_PORT)
    """The gateway's port."""
    timeout_s: float = 5.0
    """Deadline of each call."""
    workdir: Path = env_field("RECSYS_SERVE_DIR", Path("runs/serve"))
    """The running stack's state folder (``make serve``'s): whose served model's data is the
    default."""

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"
