"""Authentication and TLS on the real gateway (in front of the module's real TorchServe).

Tokens: no token / a wrong token -> UNAUTHENTICATED on Score and reflection, health open, a
token of the file scores, the file is re-read when it changes, ``serving.tools.client`` finds the
token through ``RECSYS_GATEWAY_TOKEN_FILE``. Revocation fails closed: an emptied, deleted or
unparsable file refuses every call (saying why), health NOT_SERVING and the metric 0 until fixed;
an inline comment and a same-size rotation in place take effect. TLS and mutual TLS with a throwaway CA made by the
``openssl`` CLI: TLS calls succeed, plaintext fails, mTLS without a client certificate fails
(the mTLS gateway also runs with ``auth.protect_health``: health then needs the token).
A non-loopback host without a token file refuses to start.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from recsys_stack.net import free_ports
from serving.gateway.auth import (
    AuthError,
    TokenFile,
    bearer_token,
    read_tokens,
    write_token_file,
)
from serving.gateway.config import AuthConfig, MetricsConfig, TlsConfig
from serving.gateway.exposure import check_exposure
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request, gateway_status
from serving.torchserve.config import TorchServeConfig
from tests.conftest import ROOT, _env
from tests.stack import gateway_metrics, start_gateway, stop_gateway, wait_status

pytestmark = pytest.mark.slow
T1, T2, T3 = "token-one-" + "a" * 20, "token-two-" + "b" * 20, "token-three-" + "c" * 20


# --- pure parts ------------------------------------------------------------------------------


def test_token_file_parsing_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"# comment\n\n{T1}\n  {T2}  \n")
    assert read_tokens(f) == [T1, T2]
    f.write_text(f"  # indented comment\n{T1} # inline\n{T2}\t#tab, then a comment\nab#c\n")
    assert read_tokens(f) == [T1, T2, "ab#c"]  # '#' starts a comment at a word's start only
    f.write_text("# only a comment\n")
    with pytest.raises(AuthError, match="no token"):
        read_tokens(f)
    f.write_text("two words\n")
    with pytest.raises(AuthError, match="line 1: 'words' after the token: expected tenant="):
        read_tokens(f)
    with pytest.raises(AuthError, match="missing"):
        read_tokens(tmp_path / "missing")


def test_token_file_accepts_only_its_tokens_and_rereads(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"{T1}\n{T2}\n")
    tokens = TokenFile(f, recheck_s=0.0)
    assert tokens.accepts(T1.encode()) and tokens.accepts(T2.encode())
    assert not tokens.accepts(T1[:-1].encode()) and not tokens.accepts(b"")
    f.write_text(f"{T3}\n")
    assert tokens.accepts(T3.encode()) and not tokens.accepts(T1.encode())
    f.write_text("")  # an emptied file revokes everything (fails closed)
    assert not tokens.accepts(T3.encode()) and "no token in it" in tokens.problem
    f.write_text(f"{T3} # inline comment\n")
    assert tokens.accepts(T3.encode()) and tokens.problem == ""
    f.unlink()
    assert not tokens.accepts(T3.encode()) and "No such file" in tokens.problem


def test_bearer_token_parsing() -> None:
    assert bearer_token((("authorization", "Bearer abc"),)) == b"abc"
    assert bearer_token((("authorization", "bearer  abc "),)) == b"abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None
    assert bearer_token((("x-other", "Bearer abc"),)) is None
    assert bearer_token(None) is None


def test_exposure_rule() -> None:
    check_exposure("127.0.0.1", AuthConfig())
    check_exposure("::1", AuthConfig())
    check_exposure("0.0.0.0", AuthConfig(token_file="/some/file"))
    check_exposure("0.0.0.0", AuthConfig(allow_unauthenticated=True))
    with pytest.raises(AuthError, match="allow_unauthenticated"):
        check_exposure("0.0.0.0", AuthConfig())


def test_write_token_file_is_private_and_kept(tmp_path: Path) -> None:
    f = tmp_path / "serve" / "gateway_token"
    assert write_token_file(f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    token = read_tokens(f)
    assert len(token) == 1 and len(token[0]) >= 32
    assert not write_token_file(f) and read_tokens(f) == token


def test_gateway_refuses_a_public_host_without_tokens(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported
    keys = tmp_path / "key_file.json"
    keys.write_text('{"inference": {"key": "k"}, "management": {"key": "m"}}')
    argv = [sys.executable, "-m", "serving.gateway", "--schema", str(export / "schema.json"),
            "--key-file", str(keys), "--host", "0.0.0.0"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "auth.allow_unauthenticated" in proc.stderr


# --- a real gateway with tokens ----------------------------------------------------------------


@pytest.fixture(scope="module")
def token_gateway(
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    exported: tuple[Path, Path, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path]]:
    export, _, _ = exported
    cfg, _ = torchserve
    work = tmp_path_factory.mktemp("auth")
    tokens = work / "tokens"
    tokens.write_text(f"{T1}\n{T2}\n")
    gateway, target = start_gateway(
        export / "schema.json", [cfg], work / "gateway.log",
        auth=AuthConfig(token_file=str(tokens)),
    )  # fmt: skip
    try:
        wait_status(target, "SERVING", 120)  # health needs no token
        yield target, tokens
    finally:
        assert stop_gateway(gateway) == 0


def _request(exported: tuple[Path, Path, str]) -> object:
    s = np.load(exported[0] / "sample.npz")
    from serving.worker.codec import to_rows

    return build_request(s["dense"][:3], to_rows(s["values"], s["lengths"])[:3])


def _code(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
        return "OK"
    except grpc.RpcError as e:
        return str(e.code().name)  # type: ignore[attr-defined]


def test_tokens_on_score_health_and_reflection(
    token_gateway: tuple[str, Path], exported: tuple[Path, Path, str]
) -> None:
    target, _ = token_gateway
    request = _request(exported)
    with grpc.insecure_channel(target) as ch:
        stub = ranker_pb2_grpc.RankerStub(ch)

        def score(token: str | None) -> str:
            md = (("authorization", f"Bearer {token}"),) if token else ()
            return _code(lambda: stub.Score(request, metadata=md, timeout=10))

        assert score(None) == "UNAUTHENTICATED"
        assert score("wrong") == "UNAUTHENTICATED"
        assert score(T1[:-1]) == "UNAUTHENTICATED"
        assert score(T1) == "OK" and score(T2) == "OK"
        try:
            stub.Score(request, timeout=10)
        except grpc.RpcError as e:
            assert "authorization: Bearer" in e.details()  # type: ignore[attr-defined]
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")

        def list_services(md: tuple[tuple[str, str], ...]) -> str:
            return _code(lambda: list(refl.ServerReflectionInfo(iter([ask]), metadata=md)))

        assert list_services(()) == "UNAUTHENTICATED"
        assert list_services((("authorization", f"Bearer {T1}"),)) == "OK"


def test_token_file_is_reread_by_the_running_gateway(
    token_gateway: tuple[str, Path], exported: tuple[Path, Path, str]
) -> None:
    target, tokens = token_gateway
    request = _request(exported)
    with grpc.insecure_channel(target) as ch:
        stub = ranker_pb2_grpc.RankerStub(ch)

        def score(token: str) -> str:
            md = (("authorization", f"Bearer {token}"),)
            return _code(lambda: stub.Score(request, metadata=md, timeout=10))

        assert score(T3) == "UNAUTHENTICATED"
        tokens.write_text(f"{T3}\n")
        deadline = time.monotonic() + 10
        while score(T3) != "OK":
            assert time.monotonic() < deadline, "the new token was never accepted"
            time.sleep(0.2)
        assert score(T1) == "UNAUTHENTICATED"  # revoked
        tokens.write_text(f"{T1}\n{T2}\n")


def test_client_cli_reads_the_token_file(
    token_gateway: tuple[str, Path], exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    target, tokens = token_gateway
    time.sleep(1.5)  # the previous test's restore of the file is picked up
    from tests.serving.test_supervisor import _tsv_rows

    tsv = tmp_path / "rows.tsv"
    tsv.write_text(_tsv_rows(np.load(exported[0] / "sample.npz"), 3))
    port = target.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "serving.tools.client", "--data", str(tsv), "--rows", "3"]
    env = _env({"RECSYS_GATEWAY_PORT": port, "RECSYS_SERVE_DIR": str(tmp_path / "none")})
    env.pop("RECSYS_GATEWAY_TOKEN_FILE", None)
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=60)
    refused = subprocess.run(argv, env=env, **run)  # type: ignore[call-overload]
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    ok = subprocess.run(argv, env={**env, "RECSYS_GATEWAY_TOKEN_FILE": str(tokens)}, **run)  # type: ignore[call-overload]
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.splitlines()) == 3


# --- revocation fails closed (a real gateway, its health and its metrics) ------------------------

T4 = "token-four-" + "d" * 19  # as long as T1: a same-size edit in place


@pytest.fixture(scope="module")
def revocable(
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    exported: tuple[Path, Path, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, int]]:
    """(target, token file, metrics port) of a gateway of its own: the cases break its file."""
    export, _, _ = exported
    work = tmp_path_factory.mktemp("revoke")
    tokens, port = work / "tokens", free_ports(1)[0]
    tokens.write_text(f"{T1}\n")
    gateway, target = start_gateway(
        export / "schema.json", [torchserve[0]], work / "gateway.log",
        auth=AuthConfig(token_file=str(tokens)), metrics=MetricsConfig(port=port),
    )  # fmt: skip
    try:
        wait_status(target, "SERVING", 120)
        yield target, tokens, port
    finally:
        assert stop_gateway(gateway) == 0


def _answer(target: str, request: object, token: str | None) -> tuple[str, str]:
    """(code, details) of one Score call carrying ``token``."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(target) as ch:
        try:
            ranker_pb2_grpc.RankerStub(ch).Score(request, metadata=md, timeout=10)
            return "OK", ""
        except grpc.RpcError as e:
            return str(e.code().name), str(e.details())  # type: ignore[attr-defined]


def _file_ok(port: int, tokens: Path) -> float | None:
    key = ("recsys_gateway_auth_token_file_ok", (("token_file", tokens.name),))  # not its path
    return gateway_metrics(port).get(key)


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    """Wait (generously: the machine is shared) until ``check()``; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened within {timeout:.0f} s: {what}"
        time.sleep(0.25)


def _serves_only(
    target: str, request: object, port: int, tokens: Path, good: str, metric: bool = True
) -> None:
    """``good`` is accepted (once re-read), T1 (the leaked one) is not, health is SERVING and
    (``metric``) the file is reported usable."""
    _until(f"{good[:10]}... accepted", lambda: _answer(target, request, good)[0] == "OK")
    if good != T1:
        assert _answer(target, request, T1)[0] == "UNAUTHENTICATED"
    _until("health SERVING", lambda: gateway_status(target) == "SERVING")
    if metric:
        _until("token_file_ok 1", lambda: _file_ok(port, tokens) == 1.0)


def _break(tokens: Path, case: str) -> None:
    if case == "empty":
        tokens.write_text("")
    elif case == "comments only":
        tokens.write_text("# every token revoked\n\n")
    elif case == "deleted":
        tokens.unlink()
    elif case == "not utf-8":
        tokens.write_bytes(b"\xff\xfe" + T1.encode() + b"\n")
    else:  # two words on a line: not one token per line, not a comment either
        tokens.write_text(f"{T1} {T2}\n")


@pytest.mark.parametrize("case", ["empty", "comments only", "deleted", "not utf-8", "two words"])
def test_a_broken_token_file_refuses_every_call_and_says_so(
    case: str, revocable: tuple[str, Path, int], exported: tuple[Path, Path, str]
) -> None:
    """Emptied, deleted or unparsable: the old tokens stop working at once (not kept from the
    last good read), every call is told why, health is NOT_SERVING, the metric is 0; a fixed
    file is served again."""
    target, tokens, port = revocable
    request = _request(exported)
    _serves_only(target, request, port, tokens, T1, metric=False)  # as it starts
    _break(tokens, case)
    _until("the old token refused", lambda: _answer(target, request, T1)[0] != "OK")
    for token in (T1, None):
        code, details = _answer(target, request, token)
        assert code == "UNAUTHENTICATED", (code, details)
        assert "token file cannot be used" in details, details
        assert str(tokens) not in details and tokens.name not in details, details  # the log's
    _until("health NOT_SERVING", lambda: gateway_status(target) == "NOT_SERVING")
    _until("token_file_ok 0", lambda: _file_ok(port, tokens) == 0.0)
    tokens.write_text(f"{T2}\n")  # fixed: a new token
    _serves_only(target, request, port, tokens, T2)
    tokens.write_text(f"{T1}\n")


def test_an_inline_comment_keeps_the_new_token_and_revokes_the_old(
    revocable: tuple[str, Path, int], exported: tuple[Path, Path, str]
) -> None:
    target, tokens, port = revocable
    request = _request(exported)
    _serves_only(target, request, port, tokens, T1, metric=False)  # as it starts
    tokens.write_text(f"# rotated: T1 leaked\n{T2}  # issued 2026-12-02\n")
    _serves_only(target, request, port, tokens, T2)
    tokens.write_text(f"{T1}\n")


def test_a_same_size_rotation_in_place_is_seen(
    revocable: tuple[str, Path, int], exported: tuple[Path, Path, str]
) -> None:
    """The token replaced in place by one as long, the modification time put back (``cp -p``,
    ``rsync -t``, or two writes within one tick of the file system's clock): same inode, size
    and mtime, new content."""
    target, tokens, port = revocable
    request = _request(exported)
    _serves_only(target, request, port, tokens, T1, metric=False)  # as it starts
    time.sleep(1.5)  # the gateway has looked at the file as it is
    before = tokens.stat()
    with open(tokens, "r+") as f:
        f.write(f"{T4}\n")
    os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = tokens.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns,
    )  # fmt: skip
    _serves_only(target, request, port, tokens, T4)
    tokens.write_text(f"{T1}\n")


# --- TLS and mutual TLS ------------------------------------------------------------------------


def _tls_channel(target: str, certs: dict[str, Path], client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs["ca.pem"].read_bytes(),
        private_key=certs["client.key"].read_bytes() if client_cert else None,
        certificate_chain=certs["client.pem"].read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(target, creds)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_tls_and_mutual_tls(
    mutual: bool,
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    exported: tuple[Path, Path, str],
    certs: dict[str, Path],
    tmp_path: Path,
) -> None:
    export, _, _ = exported
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{T1}\n")
    tls = TlsConfig(
        cert=str(certs["server.pem"]), key=str(certs["server.key"]),
        client_ca=str(certs["ca.pem"]) if mutual else "",
    )  # fmt: skip
    # the mTLS gateway also closes health (auth.protect_health): probes then need the token
    auth = AuthConfig(token_file=str(tokens), protect_health=mutual)
    gateway, target = start_gateway(
        export / "schema.json", [torchserve[0]], tmp_path / "gateway.log", auth=auth, tls=tls
    )
    request, md = _request(exported), (("authorization", f"Bearer {T1}"),)
    try:
        deadline = time.monotonic() + 60
        with _tls_channel(target, certs, client_cert=mutual) as ch:
            stub = ranker_pb2_grpc.RankerStub(ch)
            while (code := _code(lambda: stub.Score(request, metadata=md, timeout=10))) != "OK":
                assert code == "UNAVAILABLE" and time.monotonic() < deadline, code
                time.sleep(0.3)  # starting, or backends not probed yet
            assert _code(lambda: stub.Score(request, timeout=10)) == "UNAUTHENTICATED"
            health = health_pb2_grpc.HealthStub(ch)
            ask = health_pb2.HealthCheckRequest()
            assert _code(lambda: health.Check(ask, metadata=md, timeout=5)) == "OK"
            open_health = _code(lambda: health.Check(ask, timeout=5))
            assert open_health == ("UNAUTHENTICATED" if mutual else "OK")
        with grpc.insecure_channel(target) as ch:  # plaintext to a TLS port
            stub = ranker_pb2_grpc.RankerStub(ch)
            assert _code(lambda: stub.Score(request, metadata=md, timeout=5)) == "UNAVAILABLE"
        if mutual:  # TLS, but no client certificate
            with _tls_channel(target, certs, client_cert=False) as ch:
                stub = ranker_pb2_grpc.RankerStub(ch)
                assert _code(lambda: stub.Score(request, metadata=md, timeout=5)) == "UNAVAILABLE"
    finally:
        assert stop_gateway(gateway) == 0


def test_tls_files_that_are_not_pem_fail_with_one_line(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported
    keys = tmp_path / "key_file.json"
    keys.write_text('{"inference": {"key": "k"}, "management": {"key": "m"}}')
    (tmp_path / "cert.pem").write_text("not a certificate")
    argv = [sys.executable, "-m", "serving.gateway", "--schema", str(export / "schema.json"),
            "--key-file", str(keys), "--tls.cert", str(tmp_path / "cert.pem"),
            "--tls.key", str(tmp_path / "cert.pem")]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "not a PEM file" in proc.stderr


def test_a_token_file_others_can_write_is_refused_at_start(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Issue 45: a token file open to others was accepted silently. One others can write is
    refused at start (one line naming the file, its mode and the chmod); one they can only
    read is warned about (serving/gateway/filemode.py says why)."""
    export, _, _ = exported
    keys = tmp_path / "key_file.json"
    keys.write_text('{"inference": {"key": "k"}, "management": {"key": "m"}}')
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{T1}\n")
    tokens.chmod(0o666)
    argv = [sys.executable, "-m", "serving.gateway", "--schema", str(export / "schema.json"),
            "--key-file", str(keys), "--auth.token-file", str(tokens), "--port", "0",
            "--http-port", "-1", "--metrics.port", "0"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "others can write it" in line and f"chmod 600 {tokens}" in line, proc.stderr
