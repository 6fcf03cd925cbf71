"""The one way our tools open a channel to the gateway: TLS, mutual TLS and the bearer token.

``make score``, ``make evaluate``, ``make rollout``, the supervisor (its wait for SERVING and
``make status``), the container healthcheck and the Locust users all connect through
:func:`open_channel` and send :func:`metadata`, from one
:class:`~serving.gateway.config.ChannelConfig` read by the project's config loader:

- ``RECSYS_GATEWAY_TOKEN_FILE`` (else ``$RECSYS_SERVE_DIR/gateway_token`` when it exists): the
  bearer token, sent on every call, health checks included (``auth.protect_health``);
- ``RECSYS_CLIENT_TLS_CA``: CA bundle(s) the gateway's certificate must chain to (TLS on);
  ``RECSYS_CLIENT_TLS`` = true: TLS against the system's roots;
- ``RECSYS_CLIENT_TLS_CERT`` / ``_KEY``: the client certificate for mutual TLS;
- ``RECSYS_CLIENT_TLS_SERVER_NAME``: the name to verify when it is not the host dialled.

A tool that knows the gateway's own config (the supervisor, rollout, the container
healthcheck) completes these with :func:`for_gateway`. Imports grpc only (no health or
reflection packages): the Locust image uses this module too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from recsys_stack.config import iter_keys, load
from serving.gateway.auth import call_metadata, client_token
from serving.gateway.config import ChannelConfig, GatewayConfig
from serving.gateway.exposure import read_pem

Metadata = tuple[tuple[str, str], ...]

# Every gateway method but Feedback is side-effect free (scoring, KServe v2, health,
# reflection), and Feedback is idempotent where it counts (the joiner makes one row of a click
# reported twice), so a call that failed UNAVAILABLE or CANCELLED may go again. A takeover (a
# second gateway on the port, SIGTERM to the first: docs/chaos.md) costs exactly such calls:
# grpc core CANCELs the calls the stopping server had received but not yet handed to Python
# (grpc/grpc#41785: CANCELLED, not UNAVAILABLE, in grpc 1.81), and a reconnect that lands in
# the closing listener's accept queue is reset, after which the channel fails calls fast
# UNAVAILABLE. Up to 5 attempts (grpc's most), 100 ms - 1 s of backoff (jittered: 0.75 s
# expected, 1.5 s at most before the last) cover a takeover's reset window, which lasts as
# long as the stopping gateway takes to close its listener: tens of ms on a quiet machine,
# longer on a loaded one (with 50-800 ms, one call of a takeover failed in a busy 2-core CI
# run). Not an outage: a gateway that stays down still fails within 2 s. Throttled per
# channel (grpc's retryThrottling): once about half of 10 tokens are spent on failures, no
# retries until successes earn them back, so a gateway that answers UNAVAILABLE to everything
# (no replica left) is not asked 5 times as often. Requests over grpc's per-call retry buffer
# (256 KiB) are not retried.
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
}
# Round robin over every address the target names (``dns:///gateway:50051`` resolving to each
# gateway replica, or ``ipv4:127.0.0.1:50051,127.0.0.1:50052``): calls spread over the gateways,
# and one that stops (GOAWAY) or is down leaves the rotation while the others take its calls;
# grpc's default, pick_first, sends everything to one. With a single address it is the same.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{"name": [{}], "retryPolicy": RETRY_POLICY}],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
)
# grpc waits 1 s before its second connection attempt (then backs off to 120 s): after a reset
# connect, every call failed fast for that second (2,971 calls in one suite run). 100 ms keeps
# a failed connect within the retries' backoff. At most 1 s between attempts: grpc's own
# backoff grows 1.6x per failed attempt up to 120 s, so after a gateway was down ~10 s (a
# restart on a loaded machine) its clients may wait several seconds more before they try it
# again; a rolling restart that moves on to the other gateway meanwhile leaves them with
# neither, and every call fails fast (54,922 calls in 15 s: compose's restart test on a
# loaded machine). A gateway that is down costs each client one connect a second.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a gateway replaced under its name (a restarted container's new address) is looked up
    # again within a second of its connection closing, not grpc's 30 s
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
)


def from_env(environ: Mapping[str, str] | None = None) -> ChannelConfig:
    """The channel settings of the environment (``RECSYS_CLIENT_TLS_*``, the token file)."""
    return load(ChannelConfig, environ=environ)


def plaintext_env() -> dict[str, str]:
    """Variables that turn the TLS settings off, for a child process dialling a plaintext server."""
    return {k.env: "" for k in iter_keys(ChannelConfig) if k.env and k.path.startswith("tls")}


def credentials(cfg: ChannelConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for ``cfg`` (None = plaintext); raises AuthError naming a bad file."""
    if not cfg.tls_enabled:
        return None
    roots = b"".join(read_pem("tls_ca", p.strip()) for p in cfg.tls_ca.split(",") if p.strip())
    key = read_pem("tls_key", cfg.tls_key) if cfg.tls_key else None
    chain = read_pem("tls_cert", cfg.tls_cert) if cfg.tls_cert else None
    return grpc.ssl_channel_credentials(roots or None, key, chain)


def open_channel(
    target: str, cfg: ChannelConfig | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``target``: TLS when ``cfg`` asks for it (None = plaintext), with
    :data:`CHANNEL_OPTIONS` (retries and reconnect backoff) unless ``options`` sets the same."""
    creds = credentials(cfg) if cfg is not None else None
    given = {key for key, _ in options}
    merged = [*(o for o in CHANNEL_OPTIONS if o[0] not in given), *options]
    if creds is None:
        return grpc.insecure_channel(target, options=merged)
    assert cfg is not None
    name = [("grpc.ssl_target_name_override", cfg.tls_server_name)] if cfg.tls_server_name else []
    return grpc.secure_channel(target, creds, options=[*merged, *name])


def metadata(cfg: ChannelConfig | None) -> Metadata:
    """``authorization: Bearer <token>`` for ``cfg``'s token (empty without one, or ``cfg``)."""
    return call_metadata(client_token(cfg.token_file)) if cfg is not None else ()


def channel_fields(cfg: ChannelConfig) -> dict[str, Any]:
    """``cfg``'s channel settings as keyword arguments (for a config that extends them)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ChannelConfig)}


def for_gateway(cfg: ChannelConfig, gateway: GatewayConfig) -> ChannelConfig:
    """``cfg`` for a gateway whose own config is known (the one ``make serve`` started, the
    container's): plaintext when its TLS is off, whatever ``cfg`` says. With TLS on, what
    ``cfg`` leaves empty comes from the gateway's files: the CA = its certificate chain plus its
    ``client_ca`` (enough for a self-signed certificate, or one CA issuing both), the client
    certificate for mutual TLS = its own certificate and key (accepted when it chains to
    ``client_ca`` and may be used by clients). The token file defaults to its
    ``auth.token_file``."""
    token_file = cfg.token_file or gateway.auth.token_file
    tls = gateway.tls
    if not tls.enabled:
        return ChannelConfig(token_file=token_file)
    ca = cfg.tls_ca or ("" if cfg.tls else ",".join(p for p in (tls.cert, tls.client_ca) if p))
    cert, key = cfg.tls_cert, cfg.tls_key  # set together (ChannelConfig checks)
    if not cert and tls.client_ca:
        cert, key = tls.cert, tls.key
    return dataclasses.replace(
        cfg, token_file=token_file, tls=True, tls_ca=ca, tls_cert=cert, tls_key=key
    )
