"""gRPC stubs: generated at setup from serving/proto/ (TorchServe's protos vendored, checked
against the installed jar), never at import; a missing stub is a one-line error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from serving import protos
from tests.conftest import ROOT, _env


def test_stub_generation_is_idempotent(tmp_path: Path) -> None:
    shutil.copytree(protos.PROTO_DIR, tmp_path / "proto")
    local = tmp_path / "proto" / "demo" / "v1"
    local.mkdir(parents=True)
    (local / "echo.proto").write_text(
        'syntax = "proto3";\npackage demo.v1;\nmessage Ping { string s = 1; }\n'
        "service Echo { rpc Call(Ping) returns (Ping); }\n"
    )
    out = tmp_path / "gen"

    def gen() -> bool:
        return protos.generate(out, package="gen", proto_dir=tmp_path / "proto")

    assert gen() is True
    assert gen() is False  # up to date
    assert (out / "inference_pb2_grpc.py").is_file()
    assert (out / "recsys" / "v1" / "ranker_pb2_grpc.py").is_file()
    grpc_module = (out / "demo" / "v1" / "echo_pb2_grpc.py").read_text()
    assert "from gen.demo.v1 import echo_pb2" in grpc_module  # package-qualified imports
    (local / "echo.proto").write_text((local / "echo.proto").read_text() + "// changed\n")
    assert gen() is True


def test_vendored_torchserve_protos_equal_the_installed_jar() -> None:
    # torchserve is a dependency (make setup installs it): its absence fails, it never skips
    assert protos.drift() == [], (
        "serving/proto/ differs from the installed TorchServe's protos: "
        "run `python -m serving.protos --update-vendored`"
    )


def test_no_module_generates_stubs_at_import() -> None:
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "serving").rglob("*.py")
        if "_gen" not in p.parts and "ensure_generated()" in p.read_text() and p.name != "protos.py"
    ]
    assert offenders == []


def test_missing_stubs_are_one_line_naming_the_command() -> None:
    # None in sys.modules makes `import serving._gen` fail as if the folder were not generated.
    code = "import sys; sys.modules['serving._gen'] = None; import serving.tools.client"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("serving.stubs.StubsMissing: gRPC stubs are missing"), proc.stderr
    assert "`make setup`" in last and "`python -m serving.protos`" in last


def test_the_predictions_envelope_plus_its_body_is_protobufs_own_encoding() -> None:
    from serving.torchserve.client import (
        inference_pb2,
        predictions_envelope,
        predictions_request,
    )

    for name, version in (("dlrm-demo", ""), ("m", "1.0"), ("x" * 200, "v" * 130)):
        for size in (0, 1, 100, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 2_100_000):
            body = bytes(range(256)) * (size // 256) + bytes(size % 256)
            got = predictions_envelope(name, version, size) + body
            assert got == predictions_request(name, version, body).SerializeToString()
            back = inference_pb2.PredictionsRequest.FromString(got)
            assert (back.model_name, back.model_version, back.input["data"]) == (
                name,
                version,
                body,
            )
