"""Container healthchecks: ``torchserve`` (REST ``/ping``) or ``gateway`` (grpc.health.v1).

``python docker/healthcheck.py torchserve|gateway``; exit 0 when healthy. Ports and folders come
from the configs the servers load, with the same variables (``RECSYS_TS_INFERENCE_PORT``,
``RECSYS_TS_WORKDIR``, ``RECSYS_GATEWAY_PORT``, ``RECSYS_GATEWAY_TLS_*``, ...); the gateway is
checked over TLS with its token when it asks for them.
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
    """The gateway's health service says SERVING (it does once a backend scores a probe).

    Reached as our tools reach it (serving/tools/channel.py): the gateway's own variables say
    whether it serves TLS (``RECSYS_GATEWAY_TLS_*``) and where its tokens are
    (``RECSYS_GATEWAY_TOKEN_FILE``: the token goes along, for ``auth.protect_health``);
    ``RECSYS_CLIENT_TLS_*`` override the CA, client certificate and name to verify, which
    otherwise come from the gateway's own certificate files.
    """
    from serving.gateway.auth import AuthError
    from serving.gateway.config import GatewayConfig
    from serving.tools.channel import for_gateway, from_env
    from serving.tools.client import health

    gw = load(GatewayConfig)
    try:
        status, why = health(f"127.0.0.1:{gw.port}", timeout, for_gateway(from_env(), gw))
    except AuthError as e:  # a TLS or token file it cannot read
        status, why = "UNREACHABLE", str(e)
    if status != "SERVING":
        print(f"gateway: {status}" + (f" ({why})" if why else ""), file=sys.stderr)
    return status == "SERVING"


CHECKS = {"torchserve": torchserve, "gateway": gateway}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: python docker/healthcheck.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if CHECKS[sys.argv[1]]() else 1)
