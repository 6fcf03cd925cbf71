"""The isolation bench's stack: a model, one TorchServe, one gateway with TLS and two tokens.

* :func:`tiny_model`: a preset (``tiny`` by default: seconds) trained a few steps on synthetic
  rows and exported into a model store, in subprocesses (serving never imports training);
* :func:`make_certs`: a throwaway CA and a server certificate for 127.0.0.1/localhost, made
  with the ``openssl`` CLI;
* :func:`write_tokens`: the token file, two random tokens one per line (A: the legitimate
  client, B: the abusive tenant). Plain lines: today's parser takes nothing else, and a later
  one that reads ``token  tenant=NAME  weight=W`` makes each plain token its own tenant;
* :func:`start_stack`: TorchServe (``make serve``'s settings) and the gateway in front of it
  (TLS, the token file, REST and metrics on free ports), the gateway started with a soft
  open-files limit (``nofile``; hard unchanged) so that idle connections can exhaust it.
  Every process is registered on the caller's ``ExitStack``: an error or Ctrl-C stops all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from recsys_stack.net import free_ports
from serving.bench.model import Model, run_modules
from serving.bench.servers import _stop_gateway, start_stack_torchserve, wait_all_workers
from serving.gateway.config import ChannelConfig, GatewayConfig, MetricsConfig, TlsConfig
from serving.stubs import ranker_pb2
from serving.tools.supervisor import as_overrides, wait_serving
from serving.torchserve.config import TorchServeConfig, on_free_ports

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(work: Path, preset: str, steps: int) -> tuple[Path, Path]:
    """Train ``preset`` for ``steps`` steps on synthetic rows and export it as version 1.0;
    ``(export dir, model store)``."""
    run, store = work / "run", work / "store"
    data = [f'data.cache_dir="{work / "cache"}"', f'data.synthetic_dir="{work / "syn"}"']
    steps_args = [
        ["training.train", "--config", f"training/configs/{preset}.toml", "--run-dir", str(run),
         "--no-progress", "--resume", "none", f"train.max_steps={steps}", *data],
        ["training.export", "--run-dir", str(run), "--no-progress", "--model-store", str(store),
         "--version", "1.0", "--parity-rows", "2000"],
    ]  # fmt: skip
    run_modules(steps_args)
    return run / "export", store


def _openssl(d: Path, *args: str) -> None:
    proc = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]}: {proc.stderr.strip()[-300:]}")


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost signed by it, in ``d``
    (EC P-256, one day); ``(ca.pem, server.pem, server.key)``."""
    if shutil.which("openssl") is None:
        raise RuntimeError(
            "the openssl CLI makes the bench's certificates: apt-get install openssl"
        )
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=recsys-bench-ca")  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(d, "req", *ec, "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=recsys-bench-server")  # fmt: skip
    _openssl(d, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "server.ext")  # fmt: skip
    return d / "ca.pem", d / "server.pem", d / "server.key"


def write_tokens(path: Path) -> tuple[str, str]:
    """The token file: two random tokens, one per line (mode 0600); ``(A, B)``."""
    a, b = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    path.write_text(f"{a}\n{b}\n")
    path.chmod(0o600)
    return a, b


def soft_nofile(limit: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` setting the child's soft open-files limit to ``limit`` (hard kept;
    never above it); None for ``limit`` 0 (inherit)."""
    if limit <= 0:
        return None

    def preexec() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return preexec


@dataclass
class Stack:
    """What the clients and the measurements need of the running stack."""

    gateway: GatewayConfig
    proc: subprocess.Popen[bytes]
    ca: Path
    tokens: tuple[str, str]
    log_dir: Path
    model_name: str
    torchserve_workers: int
    gateway_code: str
    """The checkout whose serving/gateway the gateway runs."""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def channel(self) -> ChannelConfig:
        """TLS against the bench's CA, the token file's first token (A)."""
        return ChannelConfig(token_file=self.gateway.auth.token_file, tls_ca=str(self.ca))

    def log_bytes(self) -> int:
        """Bytes of every file in the gateway's log folder (its output and any file it rotates
        there: a rotated-away file no longer counts)."""
        return sum(p.stat().st_size for p in self.log_dir.rglob("*") if p.is_file())

    def rss(self) -> int:
        """The gateway's resident bytes (0 once it has exited)."""
        try:
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def cpu_s(self) -> float:
        """The gateway's user + system CPU seconds so far."""
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)


def start_stack(
    export: Path, store: Path, model: tuple[str, str], ts: TorchServeConfig, gcfg: GatewayConfig,
    work: Path, nofile: int, timeout: float, stack: contextlib.ExitStack, code: Path = ROOT,
) -> Stack:  # fmt: skip
    """TorchServe serving ``model`` (name, version) from ``store`` and the gateway in front of
    it (TLS, two tokens, REST and metrics on free ports, soft open-files limit ``nofile``), both
    ready; stopped when ``stack`` closes."""
    ts = on_free_ports(dataclasses.replace(
        ts, model_store=store, mar_file=f"{model[0]}-{model[1]}.mar", model_name=model[0],
        model_version=model[1], workdir=work / "ts",
    ))  # fmt: skip
    ts_proc = start_stack_torchserve(ts, stack)
    workers = wait_all_workers(ts, ts_proc, timeout)
    ca, cert, key = make_certs(work / "certs")
    token_file = work / "tokens"
    tokens = write_tokens(token_file)
    port, http_port, metrics_port = free_ports(3)
    gcfg = dataclasses.replace(
        gcfg, schema=(export / "schema.json").resolve(), host="127.0.0.1", port=port,
        http_port=http_port, backend=ts.grpc_inference_target, key_file=str(ts.key_file.resolve()),
        auth=dataclasses.replace(gcfg.auth, token_file=str(token_file.resolve())),
        tls=dataclasses.replace(TlsConfig(), cert=str(cert), key=str(key)),
        metrics=dataclasses.replace(MetricsConfig(), port=metrics_port, host="127.0.0.1"),
    )  # fmt: skip
    log_dir = work / "gateway-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # in its log folder (a file it writes beside itself counts as log), ``code``'s serving/
    # first on its path (not whichever checkout the venv's editable install points to), and
    # no bytecode written into that checkout
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(
        [str(code), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    source = subprocess.run(
        [sys.executable, "-c", "import serving.gateway as g; print(g.__file__)"], cwd=log_dir,
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    with open(log_dir / "gateway.log", "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "serving.gateway", *as_overrides(gcfg)], cwd=log_dir, env=env,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=soft_nofile(nofile),
        )  # fmt: skip
    stack.callback(_stop_gateway, proc)
    up = Stack(gcfg, proc, ca, tokens, log_dir, model[0], workers, str(Path(source).parents[2]))
    wait_serving(up.target, proc, timeout, up.channel(), (log_dir / "gateway.log", 0))
    return up


def max_request(model: Model, examples: int, ids: int) -> bytes:
    """The largest valid request: ``examples`` examples, ``ids`` small ids in every sparse
    feature of each, dense rows of the export's sample; serialized."""
    s = np.load(model.export / "sample.npz")
    dense = s["dense"][np.arange(examples) % s["dense"].shape[0]].astype(np.float32)
    rng = np.random.default_rng(0)
    features = [
        ranker_pb2.SparseFeature(name=name, ids=rng.integers(0, 100, examples * ids).tolist(),
                                 lengths=[ids] * examples)
        for name in model.schema["features"]["sparse"]
    ]  # fmt: skip
    req = ranker_pb2.ScoreRequest(num_examples=examples, dense=dense.reshape(-1).tolist(),
                                  sparse=features)  # fmt: skip
    return req.SerializeToString()
