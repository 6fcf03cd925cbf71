"""How our tools reach the gateway (serving/tools/channel.py): one TLS/token config for all.

Pure parts: the variables, the gateway-derived defaults, file errors. Then a real gateway with
mutual TLS and ``auth.protect_health`` in front of no TorchServe (NOT_SERVING answers: reached):
the supervisor's and healthcheck's channel reaches it from the gateway's own config, plaintext
or a missing token does not, and each refused caller is told its own reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from recsys_stack.config import ConfigError, load
from recsys_stack.net import free_ports
from serving.gateway.auth import AuthError, AuthInterceptor, TokenFile
from serving.gateway.config import AuthConfig, ChannelConfig, GatewayConfig, TlsConfig
from serving.tools.channel import credentials, for_gateway, from_env, plaintext_env
from serving.tools.client import health
from serving.tools.supervisor import launch_gateway
from tests.conftest import ROOT, _env
from tests.stack import stop_gateway, wait_status

TOKEN = "channel-test-token-" + "x" * 16


def test_client_settings_come_from_the_documented_variables() -> None:
    env = {"RECSYS_CLIENT_TLS_CA": "/ca.pem", "RECSYS_CLIENT_TLS_CERT": "/c.pem",
           "RECSYS_CLIENT_TLS_KEY": "/c.key", "RECSYS_CLIENT_TLS_SERVER_NAME": "gateway",
           "RECSYS_GATEWAY_TOKEN_FILE": "/tokens"}  # fmt: skip
    cfg = from_env(env)
    assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == ("/ca.pem", "/c.pem", "/c.key")
    assert cfg.tls_server_name == "gateway" and cfg.token_file == "/tokens" and cfg.tls_enabled
    assert not from_env({}).tls_enabled and from_env({"RECSYS_CLIENT_TLS": "true"}).tls_enabled
    assert not from_env({**env, **plaintext_env()}).tls_enabled  # what calibrate's Locust gets
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ChannelConfig(tls_cert="/c.pem")
    with pytest.raises(ConfigError, match=r"RECSYS_CLIENT_TLS_CERT: .*tls_cert and tls_key"):
        from_env({"RECSYS_CLIENT_TLS_CERT": "/c.pem"})


def test_the_gateways_tls_comes_from_its_variables_too() -> None:
    # a rule across two variables (cert and key) is checked once both are read
    env = {"RECSYS_GATEWAY_TLS_CERT": "/s.pem", "RECSYS_GATEWAY_TLS_KEY": "/s.key",
           "RECSYS_GATEWAY_TLS_CLIENT_CA": "/ca.pem"}  # fmt: skip
    assert load(GatewayConfig, environ=env).tls == TlsConfig("/s.pem", "/s.key", "/ca.pem")
    with pytest.raises(ConfigError, match="environment RECSYS_GATEWAY_PORT: port"):
        load(GatewayConfig, environ={**env, "RECSYS_GATEWAY_PORT": "http"})


def test_a_known_gateway_completes_the_client_settings() -> None:
    plain = GatewayConfig(auth=AuthConfig(token_file="/gw-tokens"))
    asked = ChannelConfig(tls_ca="/ca.pem", tls_cert="/c.pem", tls_key="/c.key")
    assert for_gateway(asked, plain) == ChannelConfig(token_file="/gw-tokens")  # it is plaintext
    tls = TlsConfig(cert="/s.pem", key="/s.key")
    got = for_gateway(ChannelConfig(), GatewayConfig(tls=tls))
    assert (got.tls_ca, got.tls_cert, got.tls_key) == ("/s.pem", "", "")
    mutual = GatewayConfig(tls=TlsConfig(cert="/s.pem", key="/s.key", client_ca="/ca.pem"))
    got = for_gateway(ChannelConfig(token_file="/mine"), mutual)
    assert (got.tls_ca, got.tls_cert, got.tls_key) == ("/s.pem,/ca.pem", "/s.pem", "/s.key")
    assert got.token_file == "/mine"
    assert for_gateway(asked, mutual) == ChannelConfig(
        tls=True, tls_ca="/ca.pem", tls_cert="/c.pem", tls_key="/c.key"
    )


def test_unreadable_tls_files_name_the_setting(tmp_path: Path) -> None:
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(AuthError, match=r"tls_ca .*bad\.pem: not a PEM file"):
        credentials(ChannelConfig(tls_ca=str(tmp_path / "bad.pem")))
    with pytest.raises(AuthError, match=r"tls_ca .*missing\.pem"):
        credentials(ChannelConfig(tls_ca=str(tmp_path / "missing.pem")))


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def test_each_refused_caller_is_told_its_own_reason(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    auth = AuthInterceptor(TokenFile(tmp_path / "tokens"), protect_health=True)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    class Details:
        def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
            self.method, self.invocation_metadata = "/recsys.v1.Ranker/Score", md

    async def refusal(md: tuple[tuple[str, str], ...]) -> str:
        denier = auth.apply(Details(md), handler)
        with pytest.raises(_Aborted) as e:
            await denier.unary_unary(None, _Context())
        return str(e.value.args[1])

    async def both() -> list[str]:
        return [await refusal(md) for md in ((("authorization", "Bearer wrong"),), ())] * 2

    wrong, missing, wrong2, missing2 = asyncio.run(both())
    assert wrong.startswith("the bearer token is not accepted") and wrong2 == wrong
    assert missing.startswith("no bearer token") and missing2 == missing


# --- a real gateway: mutual TLS, protected health, no TorchServe behind it ---------------------


@pytest.fixture(scope="module")
def mtls_gateway(
    certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayConfig]:
    d = tmp_path_factory.mktemp("mtls")
    (d / "schema.json").write_text(json.dumps({"model": {"name": "m", "version": "1"},
                                               "features": {"dense": ["I1"], "sparse": ["C1"]}}))  # fmt: skip
    (d / "keys.json").write_text('{"inference": {"key": "k"}, "management": {"key": "m"}}')
    (d / "tokens").write_text(f"{TOKEN}\n")
    (d / "tokens").chmod(0o600)
    port, nobody = free_ports(2)
    cfg = GatewayConfig(
        schema=d / "schema.json", port=port, backend=f"127.0.0.1:{nobody}",
        key_file=str(d / "keys.json"),
        auth=AuthConfig(token_file=str(d / "tokens"), protect_health=True),
        tls=TlsConfig(cert=str(certs["server.pem"]), key=str(certs["server.key"]),
                      client_ca=str(certs["ca.pem"])),
    )  # fmt: skip
    proc = launch_gateway(cfg, d / "gateway.log")
    try:
        wait_status(f"127.0.0.1:{port}", "NOT_SERVING", 60, for_gateway(ChannelConfig(), cfg))
        yield cfg
    finally:
        assert stop_gateway(proc) == 0


def _no_default_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RECSYS_GATEWAY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("RECSYS_SERVE_DIR", str(tmp_path))  # no gateway_token there


def test_only_tls_with_a_client_certificate_and_the_token_reach_protected_health(
    mtls_gateway: GatewayConfig,
    certs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    _no_default_token(monkeypatch, tmp_path)
    target = f"127.0.0.1:{mtls_gateway.port}"
    token_file = mtls_gateway.auth.token_file
    ca, cert, key = (str(certs[n]) for n in ("ca.pem", "client.pem", "client.key"))
    client = ChannelConfig(token_file=token_file, tls_ca=ca, tls_cert=cert, tls_key=key)
    assert health(target, 5, client) == ("NOT_SERVING", "")  # reached: no TorchServe behind
    assert health(target, 5, for_gateway(ChannelConfig(), mtls_gateway))[0] == "NOT_SERVING"
    assert health(target, 5)[0] == "UNREACHABLE"  # plaintext
    no_cert = ChannelConfig(token_file=token_file, tls_ca=ca)
    assert health(target, 5, no_cert)[0] == "UNREACHABLE"
    status, why = health(target, 5, ChannelConfig(tls_ca=ca, tls_cert=cert, tls_key=key))
    assert status == "UNREACHABLE" and why.startswith("UNAUTHENTICATED: no bearer token"), why


def test_refusals_name_each_callers_reason_on_the_running_gateway(
    mtls_gateway: GatewayConfig,
    certs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    _no_default_token(monkeypatch, tmp_path)
    (tmp_path / "wrong").write_text("not-the-token\n")
    tls: dict[str, Any] = {"tls_ca": str(certs["ca.pem"]), "tls_cert": str(certs["client.pem"]),
           "tls_key": str(certs["client.key"])}  # fmt: skip
    target = f"127.0.0.1:{mtls_gateway.port}"
    wrong = health(target, 5, ChannelConfig(token_file=str(tmp_path / "wrong"), **tls))[1]
    missing = health(target, 5, ChannelConfig(**tls))[1]
    assert "the bearer token is not accepted" in wrong, wrong
    assert "no bearer token" in missing, missing  # not the first caller's reason


def test_container_healthcheck_reaches_a_tls_gateway_from_its_own_variables(
    mtls_gateway: GatewayConfig, tmp_path: Path
) -> None:
    tls = mtls_gateway.tls
    env = _env({"RECSYS_GATEWAY_PORT": str(mtls_gateway.port),
                "RECSYS_GATEWAY_TLS_CERT": tls.cert, "RECSYS_GATEWAY_TLS_KEY": tls.key,
                "RECSYS_GATEWAY_TLS_CLIENT_CA": tls.client_ca,
                "RECSYS_GATEWAY_TOKEN_FILE": mtls_gateway.auth.token_file,
                "RECSYS_SERVE_DIR": str(tmp_path)})  # fmt: skip
    proc = subprocess.run([sys.executable, "docker/healthcheck.py", "gateway"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    # reached over mutual TLS with the token: it is up, and says that no backend is serving yet
    assert proc.returncode == 1 and "gateway: NOT_SERVING" in proc.stderr, proc.stderr


def _echo_server(port: int) -> grpc.Server:
    """A gRPC server on ``port`` answering ``/t.T/Echo`` with its request."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(2))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Echo": echo}),))
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def test_a_client_is_back_within_seconds_of_a_server_down_for_twenty() -> None:
    """Our channel tries a server that went away at least every second (grpc's own backoff
    grows to 120 s: after 20 s down, it was back 6.4 s after the server, and a rolling
    restart of the other gateway meanwhile leaves clients with neither; ours: 0.8 s)."""
    from serving.tools.channel import open_channel

    (port,) = free_ports(1)
    server = _echo_server(port)
    channel = open_channel(f"127.0.0.1:{port}")
    echo = channel.unary_unary("/t.T/Echo")
    try:
        assert echo(b"x", timeout=5) == b"x"
        server.stop(None).wait()
        t_down = time.monotonic()
        while time.monotonic() - t_down < 20:  # calls fail meanwhile, connects back off
            with contextlib.suppress(grpc.RpcError):
                echo(b"x", timeout=0.2)
            time.sleep(0.05)
        server = _echo_server(port)
        t_up = time.monotonic()
        while True:
            with contextlib.suppress(grpc.RpcError):
                if echo(b"x", timeout=0.5) == b"x":
                    break
            assert time.monotonic() - t_up < 5, "no answer 5 s after the server came back"
            time.sleep(0.02)
        # 1 s at most between connects (+20% jitter), generous for a busy machine
        assert time.monotonic() - t_up < 3.0
    finally:
        channel.close()
        server.stop(None)
