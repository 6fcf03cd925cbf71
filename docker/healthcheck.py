"""Container healthchecks: ``torchserve`` (REST ``/ping``) or ``gateway`` (grpc.health.v1).

``python docker/healthcheck.py torchserve|gateway``; exit 0 when healthy. Ports come from the
same variables the servers read (RECSYS_TS_INFERENCE_PORT, RECSYS_GATEWAY_PORT).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path


def torchserve(timeout: float = 3.0) -> bool:
    """TorchServe answers ``/ping`` 200 ("Healthy") once its model's workers are up.

    With token authorization on (TorchServe 0.12's default, kept) ``/ping`` needs the
    inference key too: read from ``$RECSYS_TS_WORKDIR/key_file.json``.
    """
    port = os.environ.get("RECSYS_TS_INFERENCE_PORT", "8080")
    key_file = Path(os.environ.get("RECSYS_TS_WORKDIR", "/shared/ts")) / "key_file.json"
    try:
        key = json.loads(key_file.read_text())["inference"]["key"]
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/ping", headers={"Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError, KeyError):  # not up, key not written yet, 4xx/5xx
        return False


def gateway(timeout: float = 3.0) -> bool:
    """The gateway's health service says SERVING (it does once a backend scores a probe)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"127.0.0.1:{os.environ.get('RECSYS_GATEWAY_PORT', '50051')}"
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


CHECKS = {"torchserve": torchserve, "gateway": gateway}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: python docker/healthcheck.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if CHECKS[sys.argv[1]]() else 1)
