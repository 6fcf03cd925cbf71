"""Container healthchecks: ``torchserve`` (a READY worker) or ``gateway`` (grpc.health.v1).

``python docker/healthcheck.py torchserve|gateway``; exit 0 when healthy. Ports and folders come
from the configs the servers load, with the same variables (``RECSYS_TS_INFERENCE_PORT``,
``RECSYS_TS_WORKDIR``, ``RECSYS_GATEWAY_PORT``, ``RECSYS_GATEWAY_TLS_*``, ...); the gateway is
checked over TLS with its token when it asks for them.
"""

from __future__ import annotations

import sys

from recsys_stack.config import load


def torchserve(timeout: float = 3.0) -> bool:
    """The model TorchServe serves has a READY worker (its management API's description, as
    ``make serve`` waits for it: serving.torchserve.process.ready_workers).

    Not ``/ping``: it answered 200 while the model's worker was still loading, so a replica
    scaled in was "healthy" 19 s before it could score. The management key comes from
    ``<workdir>/key_file.json`` (token authorization on, TorchServe 0.12's default, kept).
    """
    from serving.torchserve import process
    from serving.torchserve.config import TorchServeConfig, resolve_model

    try:
        cfg = resolve_model(load(TorchServeConfig))
    except (OSError, ValueError) as e:  # no archive in the model store
        print(f"torchserve: {e}", file=sys.stderr)
        return False
    if process.ready_workers(cfg, timeout) > 0:
        return True
    print(
        f"torchserve: no READY worker of {cfg.model_name} {cfg.model_version} "
        f"({cfg.mar_file}) on the management port {cfg.management_port} within {timeout:g} s",
        file=sys.stderr,
    )
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
