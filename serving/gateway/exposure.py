"""How the gateway is exposed: TLS on its port, and the rule that a port other machines can
reach is not served without tokens.

- :func:`server_credentials`: TLS (``cert`` + ``key``) or mutual TLS (+ ``client_ca``).
- :func:`check_exposure`: the gateway refuses to start on a non-loopback host with no token
  file unless ``auth.allow_unauthenticated``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from serving.gateway.auth import AuthError
from serving.gateway.config import TOKEN_FILE_ENV, AuthConfig, TlsConfig


def read_pem(key: str, path: str) -> bytes:
    """The bytes of the PEM file ``path``; AuthError naming the config ``key`` and the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AuthError(f"{key} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise AuthError(f"{key} {path}: not a PEM file")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for ``tls`` (mutual TLS when ``client_ca`` is set); None = plaintext."""
    if not tls.enabled:
        return None
    pair = (read_pem("tls.key", tls.key), read_pem("tls.cert", tls.cert))
    if tls.client_ca:
        ca = read_pem("tls.client_ca", tls.client_ca)
        return grpc.ssl_server_credentials([pair], ca, require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for wildcards and other addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth: AuthConfig) -> None:
    """Refuse (AuthError) to serve a non-loopback ``host`` without a token file."""
    if auth.token_file or auth.allow_unauthenticated or is_loopback(host):
        return
    raise AuthError(
        f"host {host} is reachable from other machines but auth.token_file is not set: set "
        f"{TOKEN_FILE_ENV} (or --auth.token-file) to a file of tokens, or pass "
        "auth.allow_unauthenticated=true to serve without authentication"
    )
