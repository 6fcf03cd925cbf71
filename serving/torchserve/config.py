"""TorchServe's configuration: ports, model, batching, state folder -> ``config.properties``.

Everything TorchServe writes goes to one work directory: ``config.properties``, the token
``key_file.json`` (TorchServe writes it into its working directory), ``logs/``, its worker
sockets (``tmp/``, so two instances on one machine never collide).

TorchServe 0.12's token authorization is kept ON (every call carries ``authorization: Bearer
<key>``). Its model API (register / unregister archives at runtime, off by default) is ON so
that ``make rollout`` can add a version without a restart: the management API binds to
``host`` (loopback by default, the internal network in compose) and needs the management key,
which only the operator's tools read (the gateway holds the inference key alone).
``allowed_urls`` keeps that API to the model store: an http(s) or file URL elsewhere is refused
(:func:`allowed_urls`), so the management key cannot fetch an archive (handler code) from
anywhere else.

With ``plan`` set (``serving/plan.py``, written by ``make serve`` and ``make rollout``), every
version in the plan is registered at start with the plan's default as TorchServe's default: a
replica that restarts serves what the gateway routes to.

Variables (``RECSYS_TS_*``, ``RECSYS_MODEL_*``) are read by :func:`recsys_stack.config.load`,
not when an instance is created: ``TorchServeConfig(...)`` in code means exactly what it says.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from recsys_stack.config import env_field
from recsys_stack.cpus import available_cpus
from recsys_stack.logpump import LogConfig
from recsys_stack.net import free_ports
from serving import plan

LOG_FILE = "torchserve.log"
WORKDIR = Path("runs/serve/torchserve")
MODEL_STORE = Path("model_store")


@dataclass
class TorchServeConfig:
    """One TorchServe instance serving one model version."""

    inference_port: int = env_field("RECSYS_TS_INFERENCE_PORT", 8080)
    """REST inference API."""
    management_port: int = env_field("RECSYS_TS_MANAGEMENT_PORT", 8081)
    """REST management API: describe, scale."""
    metrics_port: int = env_field("RECSYS_TS_METRICS_PORT", 8082)
    """Prometheus metrics, ``GET /metrics``."""
    grpc_inference_port: int = env_field("RECSYS_TS_GRPC_INFERENCE_PORT", 7070)
    """gRPC ``InferenceAPIsService``: what the gateway calls."""
    grpc_management_port: int = env_field("RECSYS_TS_GRPC_MANAGEMENT_PORT", 7071)
    """gRPC ``ManagementAPIsService``."""
    host: str = env_field("RECSYS_TS_HOST", "127.0.0.1")
    """Bind address of every API; the gateway is the public face, so TorchServe stays local
    (containers bind 0.0.0.0)."""
    workdir: Path = env_field("RECSYS_TS_WORKDIR", WORKDIR)
    """State folder: config.properties, key_file.json, logs, worker sockets."""
    model_store: Path = env_field("RECSYS_MODEL_STORE", MODEL_STORE)
    """Folder holding the .mar files (TorchServe's ``--model-store``)."""
    mar_file: str = env_field("RECSYS_MODEL_MAR", "")
    """Archive in ``model_store`` to serve; empty = ``<model_name>-<model_version>.mar`` when
    both are set, else the newest .mar in the store."""
    model_name: str = ""
    """Name the model is served under (gRPC ``model_name``, URL path); empty = the archive's."""
    model_version: str = ""
    """Version registered (and made the default) for ``model_name``; empty = the archive's."""
    plan: str = env_field("RECSYS_SERVING_PLAN", "")
    """Serving plan file; when it exists, its versions (archives, default) are registered at
    start instead of the one model above. Empty = that one model."""
    model_api: bool = env_field("RECSYS_TS_MODEL_API", True)
    """TorchServe's model API (register/unregister at runtime, management key required):
    ``make rollout`` needs it; off = the versions registered at start only (compose turns it
    off: nothing there rolls out)."""
    workers: int = env_field("RECSYS_TS_WORKERS", 0)
    """Worker processes for the model, min = max (no autoscaling surprises); 0 = one per CPU
    this process may use (measured best on CPU, docs/bench.md): its cgroup's CPU quota rounded
    up (a pod's ``limits.cpu``), else its affinity mask, never the node's core count
    (recsys_stack/cpus.py). The handler splits those CPUs among them."""
    batch_size: int = env_field("RECSYS_TS_BATCH_SIZE", 1)
    """Most requests TorchServe aggregates into one ``handle`` call. 1 by default: the gateway
    merges concurrent requests itself without a timer, while TorchServe's batching makes a
    lone request wait out max_batch_delay_ms (measured: 13 ms vs 5 ms p50, docs/bench.md)."""
    max_batch_delay_ms: int = env_field("RECSYS_TS_MAX_BATCH_DELAY_MS", 5)
    """How long TorchServe waits to fill a batch before sending what it has."""
    response_timeout_s: int = 120
    """A worker that takes longer on a batch is considered stuck and restarted."""
    startup_timeout_s: int = 120
    """Longest a worker may take to load the model."""
    job_queue_size: int = 100
    """Requests queued per model before TorchServe answers 503 (TorchServe's default). The
    gateway keeps at most ``coalesce.calls_per_worker`` calls in flight per worker, so only
    direct callers fill it; a deeper queue would hold calls past any caller's deadline."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Largest request body (REST and gRPC); TorchServe's 6.5 MB default is ~25k examples."""
    log_config: str = env_field("RECSYS_TS_LOG_CONFIG", "lean")
    """TorchServe's log4j2 configuration: ``lean`` (serving/torchserve/log4j2.xml: one stream,
    no per-request lines from the Java frontend, which measured as its largest per-request
    cost), ``default`` (TorchServe's own: access, DEBUG and metrics logs), or a file path."""
    log: LogConfig = field(default_factory=lambda: LogConfig(per_kind=0))
    """Rotation of ``<workdir>/torchserve.log``, where TorchServe's stdout and stderr go
    (recsys_stack/logpump.py); no rate limit by default: only the gateway reaches TorchServe,
    and its per-batch worker lines are counted (tests, the batching check)."""
    jvm_args: str = env_field("RECSYS_TS_JVM_ARGS", "")
    """Extra flags for TorchServe's Java frontend (its ``vmargs``), split on spaces; empty =
    the JVM's defaults (tiered C1+C2 compilation, G1: best for a long-lived server). A fleet
    of short-lived instances (the test suite starts ~35) gives ``-XX:TieredStopAtLevel=1
    -XX:+UseSerialGC``: measured here 2.2 vs 3.4 CPU-s to READY and 8 vs 11 CPU-ms a call
    over an instance's first 300 calls, JIT threads idle sooner."""
    token_expiration_min: float = 60 * 24 * 365
    """Lifetime of the keys in key_file.json; TorchServe's default (60 min) would lock out a
    gateway that read the key once, so a long-lived instance gets a long-lived key."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            port = getattr(self, f.name)
            if f.name.endswith("_port") and not 0 < port < 65536:
                raise ValueError(f"{f.name} = {port} is not a port number (1-65535)")

    def worker_count(self) -> int:
        """``workers``, with 0 resolved to the CPUs this process may use (cgroup quota)."""
        return self.workers or available_cpus()

    @property
    def mar(self) -> str:
        return self.mar_file or f"{self.model_name}-{self.model_version}.mar"

    @property
    def key_file(self) -> Path:
        return self.workdir / "key_file.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / LOG_FILE

    @property
    def grpc_inference_target(self) -> str:
        return f"{self.host}:{self.grpc_inference_port}"


LEAN_LOG_CONFIG = Path(__file__).with_name("log4j2.xml")


def log_config_file(cfg: TorchServeConfig) -> Path | None:
    """The log4j2 file ``--log-config`` gets (None: TorchServe's default)."""
    if cfg.log_config == "default":
        return None
    path = LEAN_LOG_CONFIG if cfg.log_config == "lean" else Path(cfg.log_config)
    if not path.is_file():
        raise FileNotFoundError(f"log_config: {path} not found (lean, default or a file)")
    return path.resolve()


def newest_mar(store: Path) -> str:
    """The most recently written archive in ``store`` (its file name)."""
    mars = sorted(store.glob("*.mar"), key=lambda p: p.stat().st_mtime)
    if not mars:
        raise FileNotFoundError(f"no .mar in {store}: run `make export` first")
    return mars[-1].name


def model_from_mar(mar: Path) -> tuple[str, str]:
    """``(modelName, modelVersion)`` from the archive's manifest."""
    try:
        with zipfile.ZipFile(mar) as z:
            model = json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]
        return str(model["modelName"]), str(model["modelVersion"])
    except FileNotFoundError:
        raise FileNotFoundError(f"{mar} not found: run `make export` or set mar_file") from None
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise ValueError(f"{mar} is not a model archive: {e}") from None


def resolve_model(cfg: TorchServeConfig) -> TorchServeConfig:
    """``cfg`` with ``mar_file``, ``model_name`` and ``model_version`` all filled in.

    An explicit archive names the model (from its manifest) unless name/version are set; a name
    and version name the archive; with neither, the newest archive in the store is served.
    """
    if not cfg.mar_file and cfg.model_name and cfg.model_version:
        return dataclasses.replace(cfg, mar_file=cfg.mar)
    mar = cfg.mar_file or newest_mar(cfg.model_store)
    name, version = model_from_mar(cfg.model_store / mar)
    return dataclasses.replace(
        cfg,
        mar_file=mar,
        model_name=cfg.model_name or name,
        model_version=cfg.model_version or version,
    )


def served_versions(cfg: TorchServeConfig) -> tuple[str, dict[str, str], str]:
    """``(model name, {version: archive}, default version)`` to register at start: the plan's
    when ``cfg.plan`` exists, else ``cfg``'s one model."""
    if cfg.plan and Path(cfg.plan).is_file():
        p = plan.load(Path(cfg.plan))
        return p.model, {v: e.mar for v, e in p.versions.items()}, p.default
    return cfg.model_name, {cfg.model_version: cfg.mar}, cfg.model_version


def version_settings(cfg: TorchServeConfig) -> dict[str, object]:
    """Per-version TorchServe settings (config.properties' ``models``), as registered at start
    and by the management API at runtime (serving/torchserve/manage.py)."""
    return {
        "minWorkers": cfg.worker_count(),
        "maxWorkers": cfg.worker_count(),
        "batchSize": cfg.batch_size,
        "maxBatchDelay": cfg.max_batch_delay_ms,
        "responseTimeout": cfg.response_timeout_s,
        "startupTimeout": cfg.startup_timeout_s,
    }


def java_regex_literal(text: str) -> str:
    """``text`` as a Java regex matching exactly it: letters, digits, ``/`` and ``_`` as they
    are, other ASCII punctuation backslashed, the rest (comma: TorchServe splits
    ``allowed_urls`` on it; spaces, non-ASCII) as ``\\x{hex}``."""
    out = []
    for c in text:
        if c.isascii() and (c.isalnum() or c in "/_"):
            out.append(c)
        elif c.isascii() and c.isprintable() and c not in ", ":
            out.append("\\" + c)
        else:
            out.append(f"\\x{{{ord(c):x}}}")
    return "".join(out)


def allowed_urls(cfg: TorchServeConfig) -> str:
    """TorchServe's ``allowed_urls``: the URLs its model API may register an archive from.

    TorchServe matches the list (comma-separated Java regexes, case-insensitive) against a
    ``url`` that looks like a URL (``http(s)://``, ``file://``) and downloads what matches into
    the store; its default, ``file://.*|http(s)?://.*``, lets the management key install handler
    code from any server. A bare file name (what ``make rollout`` registers,
    serving/torchserve/manage.py) is no URL: TorchServe opens that file in the model store
    without matching it. The one pattern here admits a ``file://`` URL of an archive directly in
    the model store (case-sensitive, no ``%`` escapes, no sub-folder) and nothing else."""
    store = java_regex_literal(str(cfg.model_store.resolve()))
    return f"(?-i)file://{store}/[\\w.-]+\\.mar"


def properties(cfg: TorchServeConfig) -> dict[str, object]:
    """TorchServe's ``config.properties`` for ``cfg`` (model fields resolved)."""
    store = cfg.model_store.resolve()
    name, mars, default = served_versions(cfg)
    model = {
        name: {
            v: {"defaultVersion": v == default, "marName": mar, **version_settings(cfg)}
            for v, mar in mars.items()
        }
    }
    return {
        "inference_address": f"http://{cfg.host}:{cfg.inference_port}",
        "management_address": f"http://{cfg.host}:{cfg.management_port}",
        "metrics_address": f"http://{cfg.host}:{cfg.metrics_port}",
        "grpc_inference_address": cfg.host,
        "grpc_management_address": cfg.host,
        "grpc_inference_port": cfg.grpc_inference_port,
        "grpc_management_port": cfg.grpc_management_port,
        "model_store": store,
        # both are needed: load_models picks the archive, models= carries its settings
        "load_models": ",".join(mars.values()),
        "models": json.dumps(model, separators=(",", ":")),
        "default_workers_per_model": cfg.worker_count(),
        "default_response_timeout": cfg.response_timeout_s,
        "default_startup_timeout": cfg.startup_timeout_s,
        "job_queue_size": cfg.job_queue_size,
        "max_request_size": cfg.max_request_bytes,
        "max_response_size": cfg.max_request_bytes,
        "disable_token_authorization": "false",
        "token_expiration_min": cfg.token_expiration_min,
        "enable_model_api": str(cfg.model_api).lower(),
        "allowed_urls": allowed_urls(cfg),  # the model store only: no archive from elsewhere
        "install_py_dep_per_model": "false",  # the venv is the environment; no pip at load
        "metrics_mode": "prometheus",
        "enable_metrics_api": "true",
        "enable_envvars_config": "false",  # no TS_* variable silently overrides this file
        **({"vmargs": " ".join(cfg.jvm_args.split())} if cfg.jvm_args.strip() else {}),
    }


def on_free_ports(cfg: TorchServeConfig, avoid: Collection[int] = ()) -> TorchServeConfig:
    """``cfg`` on loopback with its five ports free ones (tests, benchmarks: instances side by
    side on one machine), none of ``avoid`` (ports named elsewhere, not bound yet)."""
    p = free_ports(5, avoid=avoid)
    return dataclasses.replace(
        cfg, host="127.0.0.1", inference_port=p[0], management_port=p[1], metrics_port=p[2],
        grpc_inference_port=p[3], grpc_management_port=p[4],
    )  # fmt: skip


def write_properties(cfg: TorchServeConfig) -> Path:
    """Write ``<workdir>/config.properties`` for ``cfg``; returns its path."""
    props = properties(cfg)  # the plan read once: the archives checked are the ones written
    for mar in str(props["load_models"]).split(","):
        archive = cfg.model_store.resolve() / mar
        if not archive.is_file():
            raise FileNotFoundError(f"{archive} not found: run `make export` or set mar_file")
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    path = cfg.workdir / "config.properties"
    # Java reads the file as .properties, where a backslash escapes: written doubled
    body = "".join(f"{k}={str(v).replace(chr(92), chr(92) * 2)}\n" for k, v in props.items())
    path.write_text(f"# written by serving.torchserve; edits are overwritten on start\n{body}")
    return path
