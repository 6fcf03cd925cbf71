"""gRPC gateway: ``recsys.v1.Ranker/Score`` and KServe v2 -> TorchServe gRPC ``Predictions``.

``python -m serving.gateway --schema runs/demo/export/schema.json`` (see ``--help``). A
``grpc.aio`` server with the standard health service (NOT_SERVING until TorchServe reports the
model ready, polled in the background) and server reflection (grpcurl works without protos);
KServe v2 over HTTP too (``http_port``, :mod:`serving.gateway.rest`) on the same event loop.
This module wires the process (services, health, plan, signals); the scoring path is
:mod:`serving.gateway.ranker`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from recsys_stack.config import ConfigError, parse
from serving.gateway import connections, featurelog, kserve, logs, metrics, rest, tenant_metrics
from serving.gateway.admission import AdmissionInterceptor
from serving.gateway.auth import AuthError, identifier, refusal
from serving.gateway.auth import interceptors as auth_interceptors
from serving.gateway.backends import BackendPool
from serving.gateway.config import GatewayConfig
from serving.gateway.discovery import Discovery
from serving.gateway.exposure import check_exposure, server_credentials
from serving.gateway.memory import RECLAIM, keep_freed_memory
from serving.gateway.metrics_http import read_tokens as read_metrics_tokens
from serving.gateway.plan_watcher import PlanWatcher, schema_plan
from serving.gateway.ranker import ENVELOPE_BYTES, SERVICE, Ranker
from serving.gateway.rpc import Chain, HandlerInterceptor, Routes, add_servicer, quiet_core_errors
from serving.gateway.validate import Schema
from serving.plan import Plan, PlanError, ordered
from serving.stubs import kserve_pb2, ranker_pb2, ranker_pb2_grpc, reflection_pool
from serving.torchserve.keys import KeyFileError, inference_key
from serving.worker.codec import body_bytes

logger = logging.getLogger("serving.gateway")


def check_limits_fit(cfg: GatewayConfig, schema: Schema) -> None:
    """Everything validation accepts must reach TorchServe: the largest request the limits
    allow (max examples x max ids per feature, as int64 in the body) within its body limit."""
    lim = cfg.limits
    largest = body_bytes(
        lim.max_examples,
        len(schema.dense),
        len(schema.sparse),
        lim.max_examples * len(schema.sparse) * lim.max_ids_per_feature,
    )
    if largest + ENVELOPE_BYTES > cfg.backend_max_bytes:
        raise ValueError(
            f"limits: the largest request they allow ({lim.max_examples} examples x "
            f"{lim.max_ids_per_feature} ids per feature) is a {largest}-byte TorchServe body, over "
            f"backend_max_bytes = {cfg.backend_max_bytes}: lower the limits or raise both "
            "backend_max_bytes and TorchServe's max_request_bytes"
        )


def backend_options(cfg: GatewayConfig) -> list[tuple[str, int]]:
    """Channel options toward TorchServe: messages up to its body limit (plus the request's
    envelope), whatever the public request limit is."""
    size = cfg.backend_max_bytes + 64 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def apply_plan(ranker: Ranker, plan: Plan) -> None:
    ranker.set_plan(plan)
    plan_file = str(Path(ranker.cfg.plan).resolve()) if ranker.cfg.plan else ""
    metrics.show_plan(plan.model, ordered(plan), plan.shares(), plan.generation, plan_file)
    logger.info(
        "plan %d: %s versions %s, default %s, traffic %s%s",
        plan.generation, plan.model, list(ordered(plan)), plan.default,
        plan.traffic or {plan.default: 100},
        f", cordoned {list(plan.cordon)}" if plan.cordon else "",
    )  # fmt: skip


async def poll_health(
    cfg: GatewayConfig,
    ranker: Ranker,
    watcher: PlanWatcher | None,
    servicer: health.aio.HealthServicer,
    auth_gate: Sequence[HandlerInterceptor] = (),
    model: kserve.Model | None = None,
) -> None:
    """Applies plan changes, probes every backend for every version; SERVING while at least
    one backend answers for the default version, the deadline gate is not refusing every
    call (:meth:`Admission.refusing_all`) and the token file can be used (an emptied or broken
    one refuses every call: :func:`auth.refusal`), NOT_SERVING otherwise; KServe's server
    readiness (``model``, gRPC and HTTP) follows it. After a burst of large requests, hands
    the heap's free pages back (:class:`serving.gateway.memory.Reclaim`)."""
    status = None
    schema = ranker.schema
    while True:
        try:
            if watcher is not None and (new_plan := watcher.poll()) is not None:
                apply_plan(ranker, new_plan)
            ok = await ranker.pool.refresh(
                list(ordered(ranker.plan)), len(schema.dense), len(schema.sparse)
            )
            ranker.retune_slots()
        except Exception:  # never let the poller die: health would be stuck where it was
            logger.exception("health probe failed; NOT_SERVING until a probe succeeds")
            ok = False
        if ok and ranker.admission.refusing_all():
            logger.warning("the deadline gate refuses every call: NOT_SERVING")
            ok = False
        if problem := refusal(auth_gate):  # the TokenFile logged it when it broke
            ok = False
        if model is not None:
            model.serving = ok
        new = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if new != status:
            shown = health_pb2.HealthCheckResponse.ServingStatus.Name(new)
            logger.info("gateway is %s%s", shown, f" ({problem})" if problem else "")
            status = new
            for name in ("", SERVICE):
                await servicer.set(name, new)
        if RECLAIM.due():  # a burst of large requests is over: its free pages go back
            await asyncio.to_thread(RECLAIM.tick)
        await asyncio.sleep(cfg.health_interval_s)


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT; then stop accepting and let in-flight calls finish."""
    # One thread for the work taken off the loop (decoding, merging and encoding megabyte
    # requests): with asyncio's default of cores + 4 threads, a burst of large requests had 6
    # threads contending for the GIL and every loop step waited its turn behind them (health
    # p99 45-93 ms under tests/serving/test_overload.py; 25-37 ms with one thread, more calls
    # served). Numpy's copies release the GIL, so one thread loses little.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload")
    )
    connections.quiet_accept_errors(loop)  # EMFILE at accept: one line per 10 s, no tracebacks
    schema = Schema.load(cfg.schema)
    check_limits_fit(cfg, schema)
    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    caps = connections.fit(cfg.connections, open_files, http=cfg.http_port >= 0)
    quiet_core_errors()  # a message over the size limit: one DEBUG line, not a traceback
    options = [
        ("grpc.max_receive_message_length", 2 * cfg.limits.max_request_bytes),
        ("grpc.max_send_message_length", 2 * cfg.limits.max_request_bytes),
        *connections.grpc_options(caps),
    ]
    m = metrics.configure(cfg.limits.max_examples, cfg.coalesce.max_examples)
    pool = BackendPool(
        cfg.backend,
        cfg.key_file,
        schema.model_name,
        cfg.deadline_s,
        backend_options(cfg),
        cfg.deadline_per_mb_s,
        cfg.hedge,
    )
    check_exposure(cfg.host, cfg.auth)
    credentials = server_credentials(cfg.tls)
    watcher = PlanWatcher(Path(cfg.plan), schema) if cfg.plan else None
    plan = watcher.load() if watcher else schema_plan(schema)
    ranker = Ranker(cfg, schema, pool, plan)
    apply_plan(ranker, plan)
    if cfg.feature_log.enabled:  # a thread of its own writes what the scoring path enqueues
        ranker.feature_log = featurelog.FeatureLog(cfg.feature_log, schema.model_name, ranker.ids)
        featurelog.register(m.registry, ranker.feature_log)
    scoring = (f"/{SERVICE}/Score", f"/{kserve.SERVICE}/ModelInfer")
    # metrics outermost: refused calls are counted with their code too; admission after auth:
    # an unauthenticated caller learns nothing about the load. One chain: one level per call
    auth_gate = auth_interceptors(cfg.auth)
    admission = AdmissionInterceptor(ranker.admission, scoring, identifier(auth_gate))
    tenant_metrics.register(m.registry, ranker.admission.fair)
    routes = Routes(Chain(metrics.MetricsInterceptor(m), *auth_gate, admission))
    server = grpc.aio.server(options=options)  # no interceptors: routes applies the chain
    m.track_in_flight(lambda: ranker.in_flight)
    add_servicer(routes, ranker_pb2_grpc.add_RankerServicer_to_server, ranker, raw=("Score",))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, routes)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    model = kserve.Model(ranker)
    model.serving = False  # until the first health round says otherwise
    kserve.add_to_server(model, routes)  # KServe v2, same port and scoring path
    names = (SERVICE, kserve.SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    descriptors = reflection_pool(
        ranker_pb2.DESCRIPTOR, kserve_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR,
        reflection_pb2.DESCRIPTOR,
    )  # fmt: skip
    # what enable_server_reflection does for a grpc.aio server (it checks the server's type)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(names, pool=descriptors), routes
    )
    server.add_generic_rpc_handlers((routes,))
    address = f"{cfg.host}:{cfg.port}"
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc's "Failed to bind": one line, what to do
        raise PortInUse(
            f"cannot listen on {address}: in use by another process (another gateway? "
            f"`make status`, `make stop`), or set RECSYS_GATEWAY_PORT / --port"
        ) from None
    await server.start()
    mc = cfg.metrics  # loopback unless exposed on purpose; a token; one render a second
    metrics_server = metrics.start_server(
        m, mc.host or cfg.host, mc.port, mc.token_file, mc.cache_s
    )
    # KServe v2 over HTTP: the same model, auth, admission and metrics, on this loop
    http_cfg = dataclasses.replace(cfg, connections=caps)  # the caps as fitted
    http = await rest.start(http_cfg, rest.Rest(model, ranker.admission, auth_gate, m))
    logger.info(
        "gateway on %s:%d (%s, %s) -> TorchServe %s, model %s versions %s",
        cfg.host,
        port,
        "mutual TLS" if cfg.tls.client_ca else "TLS" if credentials else "plaintext",
        f"tokens of {cfg.auth.token_file}" if cfg.auth.token_file else "no authentication",
        cfg.backend,
        plan.model,
        "/".join(ordered(plan)),
    )
    poller = asyncio.create_task(
        poll_health(cfg, ranker, watcher, health_servicer, auth_gate, model)
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    logger.info("stopping: %.1fs grace for in-flight calls", cfg.grace_s)
    poller.cancel()
    model.serving = False  # HTTP probes see /v2/health/ready 503 while calls drain
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # Calls already handed to our code finish within the grace. Those grpc core has received
    # but not yet handed over are CANCELLED by it at once (grpc/grpc#41785), and a connection
    # still in the listener's accept queue (the port shared with a successor: SO_REUSEPORT) is
    # reset unless net.ipv4.tcp_migrate_req = 1. grpc.aio can neither drain nor close only the
    # listener first, so our clients retry both (serving/tools/channel.py; docs/chaos.md).
    # aiohttp closes its listener first, then lets calls in flight finish within the grace
    await asyncio.gather(server.stop(cfg.grace_s), *([http[0].cleanup()] if http else []))
    await pool.close()
    if ranker.feature_log is not None:  # every call has ended: its queue holds all there is
        await asyncio.to_thread(ranker.feature_log.close)
    if metrics_server is not None:
        metrics_server.close()


class PortInUse(RuntimeError):
    """The gateway's port could not be bound."""


def parse_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """``argv`` -> the gateway's config (``--help`` lists every key with its docstring)."""
    return parse(GatewayConfig, argv, "python -m serving.gateway", __doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``recsys-gateway``): check the schema and key files, then serve."""
    try:
        cfg = parse_args(argv)
        logging.basicConfig(
            level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        schema = Schema.load(cfg.schema)
        check_limits_fit(cfg, schema)
        if cfg.plan:  # readable, and for this gateway's model and request contract
            PlanWatcher(Path(cfg.plan), schema).load()
        for _, path in Discovery(cfg.backend, cfg.key_file).fixed():
            try:  # TorchServe writes its keys when it starts: it may start after the gateway
                inference_key(path)  # its key alone: never the management one
            except KeyFileError as e:
                logger.warning("%s; NOT_SERVING until it is readable", e)
        check_exposure(cfg.host, cfg.auth)
        auth_interceptors(cfg.auth)  # the token file is readable
        if cfg.metrics.token_file:
            read_metrics_tokens(cfg.metrics.token_file)  # and the metrics' one
        server_credentials(cfg.tls)  # the PEM files are
        featurelog.request_ids(cfg.feature_log)  # the request-id key (made when missing)
        logs.configure(cfg)  # from here: rate-limited, rotated, after a start mark (logs.py)
    except (ConfigError, OSError, KeyError, ValueError, KeyFileError, AuthError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keep_freed_memory()  # a request reuses the last one's memory: no page faults (memory.py)
    connections.raise_open_files_limit()  # 1,024 is a thousand connections (connections.py)
    try:
        asyncio.run(serve(cfg))
    except PortInUse as e:
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
