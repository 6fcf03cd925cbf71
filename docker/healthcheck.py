"""Container healthchecks: ``torchserve`` (REST ``/ping``) or ``gateway`` (grpc.health.v1).

``python docker/healthcheck.py torchserve|gateway``; exit 0 when healthy. Ports and folders come
from the configs the servers load, with the same variables (``RECSYS_TS_INFERENCE_PORT``,
``RECSYS_TS_WORKDIR``, ``RECSYS_GATEWAY_PORT``, ...).
"""

from __future__ import annotations

import sys
import urllib.request

from recsys_stack.config import load


def torchserve(timeout: float = 3.0) -> bool:
    """TorchServe answers ``/ping`` 200 ("Healthy") once its model's workers are up.

    With token authorization on (TorchServe 0.12's default, kept) ``/ping`` needs the
    inference key too, from ``<workdir>/key_file.json``.
    """
    from serving.torchserve.config import TorchServeConfig
    from serving.torchserve.keys import KeyFileError, inference_key

    cfg = load(TorchServeConfig)
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{cfg.inference_port}/ping",
            headers={"Authorization": f"Bearer {inference_key(cfg.key_file)}"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (OSError, KeyFileError):  # not up, key not written yet, 4xx/5xx
        return False


def gateway(timeout: float = 3.0) -> bool:
    """The gateway's health service says SERVING (it does once a backend scores a probe)."""
    from serving.gateway.config import GatewayConfig
    from serving.tools.client import gateway_status

    return gateway_status(f"127.0.0.1:{load(GatewayConfig).port}", timeout) == "SERVING"


CHECKS = {"torchserve": torchserve, "gateway": gateway}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: python docker/healthcheck.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if CHECKS[sys.argv[1]]() else 1)
