"""Shared fixtures of the serving tests: TorchServe (+ gateway) on free ports (tests/stack.py),
and a throwaway certificate authority for the TLS tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import stack, torchserve

__all__ = ["certs", "stack", "torchserve"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> dict[str, Path]:
    """A throwaway CA (``ca.pem``), a server certificate for 127.0.0.1/localhost
    (``server.pem``/``.key``), a client certificate (``client.pem``/``.key``) and a self-signed
    server certificate that is its own CA (``self.pem``/``.key``), all PEM."""
    if shutil.which("openssl") is None:  # in every Debian/Ubuntu base image
        pytest.fail("the openssl CLI is needed to make test certificates: apt-get install openssl")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=recsys-test-ca", cwd=d)  # fmt: skip
    _openssl("req", "-x509", *ec, "-keyout", "self.key", "-out", "self.pem", "-days", "1",
             "-subj", "/CN=recsys-test-self",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=recsys-test-{name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    names = (
        "ca.pem",
        "server.pem",
        "server.key",
        "client.pem",
        "client.key",
        "self.pem",
        "self.key",
    )
    return {n: d / n for n in names}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """:func:`make_certs` in a folder of the module's."""
    return make_certs(tmp_path_factory.mktemp("certs"))
