"""The gateway's log: one rate-limited line per kind of fault, in a rotated file, marked at start.

Measured before: plaintext sent to the TLS port made grpc-core write one line per connection to
fd 2 (16 clients: 5.3 MB in 24 s), and each malformed HTTP request to the KServe REST port one
traceback (formatted on the event loop: 64 malformed-request loops took another client's p99
from 48 to 888 ms), into a file appended across restarts and never rotated. Now:

- grpc-core logs at ERROR and above (``GRPC_VERBOSITY``, which it reads once, at import:
  ``python -m serving.gateway`` sets it first unless it is set; the TLS handshake failure is an
  INFO line in grpc 1.81);
- whatever is still written to fd 1 or 2 (grpc-core, Python logging, a crash's last words) goes
  through :mod:`recsys_stack.logpump`: each kind of line at most ``log.per_kind`` times per
  ``log.interval_s``, into ``log.file`` rotated by size (or stderr), after one start mark;
- a request aiohttp cannot parse (``aiohttp.server``'s ``Error handling request`` with the
  parser's exception) is one WARNING line naming the peer and the parser's complaint, without a
  traceback: the client's garbage, not a fault of ours.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from aiohttp.http_exceptions import HttpProcessingError

from recsys_stack import logpump
from serving.gateway.config import GatewayConfig


def configure(cfg: GatewayConfig) -> None:
    """Route this process's output through the pump (unless ``log`` asks for neither a file
    nor a limit; DEBUG: no limit), after one start mark; called once, by ``main``, once the
    config's checks passed (a refused start stays one ``error:`` line on stderr)."""
    log = cfg.log
    if cfg.log_level == "DEBUG":  # asked for every line: the per-call ones are the point
        log = dataclasses.replace(log, per_kind=0)
    if log.file or log.per_kind:
        logpump.capture(log, Path(log.file).resolve() if log.file else None, mark(cfg))
    logging.getLogger("aiohttp.server").addFilter(one_line_for_bad_requests)


def mark(cfg: GatewayConfig) -> str:
    """The start line: which process, which code, and what it serves where."""
    tls = "mutual TLS" if cfg.tls.client_ca else "TLS" if cfg.tls.enabled else "plaintext"
    metrics = (
        f"{cfg.metrics.host or cfg.host}:{cfg.metrics.port}"
        + (" (token)" if cfg.metrics.token_file else "")
        if cfg.metrics.port
        else "off"
    )
    return (
        f"gateway start: pid {os.getpid()}, recsys-stack {logpump.version()}, "
        f"gRPC {cfg.host}:{cfg.port} ({tls}, {'tokens' if cfg.auth.token_file else 'no auth'}),"
        f" HTTP {cfg.http_port if cfg.http_port >= 0 else 'off'}, metrics {metrics}, "
        f"backend {cfg.backend}, schema {cfg.schema}, log level {cfg.log_level}"
    )


def one_line_for_bad_requests(record: logging.LogRecord) -> bool:
    """A logger filter for ``aiohttp.server``: a record carrying a parser error (the client
    sent something that is not HTTP we accept) becomes one WARNING line, no traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, HttpProcessingError):
        said = str(exc.message).strip().splitlines()
        why = repr(said[0][:120])[1:-1] if said else ""  # client bytes: escaped, one line
        record.msg, record.args = "%s: %s %d: %s", (record.getMessage(), type(exc).__name__,
                                                    exc.code, why)  # fmt: skip
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True
