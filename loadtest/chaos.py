"""``python -m loadtest.chaos`` (``make chaos``): faults under load, and how the stack recovers.

    python -m loadtest.chaos --gateway.schema runs/demo/export/schema.json --duration 2m

starts two TorchServe replicas and a gateway on free ports (the product's launchers), runs
headless Locust against the gateway for ``duration`` and injects one fault of ``schedule``
every ``interval_s``, one component at a time (the next fault waits until the last one's
replica is back in rotation). Faults (``loadtest/faults.py``): kill-worker, kill-workers,
kill-replica (and restart it), pause-replica (SIGSTOP ``pause_s``), gateway-takeover (a second
gateway on the same port, then SIGTERM to the first). Replica faults alternate between the
replicas.

Writes ``--out`` (default ``reports/chaos-<timestamp>/``): ``report.json`` (success ratio,
failures by gRPC code, per event: time to ready, back in rotation, to recover; per phase
between faults: p50/p99; gateway RSS), ``chaos.png`` (every call's latency over time, by the
replica that answered, faults marked), Locust's CSVs, per-call records (``requests/``) and every
process's log. Prints a table. Exit codes: 0 the run meets the acceptance (``min_success_ratio``,
``max_rotation_s``, ``max_rss_growth``), 3 it does not (each miss on one line), 1 the stack or
Locust failed, 2 bad options.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import chaos_report as cr
from loadtest.chaos_report import LOG_ENV
from loadtest.config import ROOT, LoadConfig, resolve_data, seconds
from loadtest.faults import FAULTS, Cluster, Event, Replica, sample_rss, start_gateway, stop_all
from loadtest.faults import ready_pids as _ready_pids
from loadtest.locust_runner import end_load, run_locust
from loadtest.run import git_commit
from recsys_stack import config as rc
from recsys_stack.net import free_ports
from recsys_stack.progress import progress
from recsys_stack.typed import suggest
from serving.gateway.config import GatewayConfig
from serving.gateway.validate import Schema
from serving.torchserve import process
from serving.torchserve.config import MODEL_STORE, TorchServeConfig, on_free_ports, resolve_model

log = logging.getLogger("loadtest.chaos")
LOCUSTFILE = ROOT / "loadtest" / "chaos_locustfile.py"
# The replica restart fourth, not last: it is the slowest to recover (Java, workers, model
# load: 15-18 s here), and last in a 2-minute run (due at 100 s) a restart of 18.4 s ended
# after the load, so its return to rotation was never seen. The gateway takeover (ready in
# <1 s) goes last instead.
DEFAULT_SCHEDULE = [
    "kill-worker",
    "kill-workers",
    "pause-replica",
    "kill-replica",
    "gateway-takeover",
]
ACCEPTANCE_EXIT = 3


@dataclass
class ChaosConfig:
    """Two TorchServe replicas + a gateway under Locust, with a schedule of faults."""

    duration: str = "2m"
    """How long Locust runs at least, e.g. 40s, 2m (see ``max_extension_s``)."""
    interval_s: float = 20.0
    """Seconds between faults (the first one after one interval)."""
    schedule: list[str] = field(default_factory=lambda: list(DEFAULT_SCHEDULE))
    """Faults in order: kill-worker, kill-workers, kill-replica, pause-replica, gateway-takeover."""
    users: int = 4
    """Concurrent closed-loop Locust users."""
    examples: int = 100
    """Examples per request."""
    timeout_s: float = 5.0
    """Deadline of each call; a call past it counts as a failure (DEADLINE_EXCEEDED)."""
    data: Path | None = None
    """Criteo TSV for payloads (default: the first data/synthetic/*.tsv)."""
    model_store: Path = rc.env_field("RECSYS_MODEL_STORE", MODEL_STORE)
    """Folder holding the schema's <name>-<version>.mar."""
    workers: int = 2
    """TorchServe workers per replica (kill-workers kills them all)."""
    pause_s: float = 5.0
    """How long pause-replica keeps a replica stopped (SIGSTOP ... SIGCONT)."""
    warmup_s: float = 30.0
    """Load seconds before a gateway's RSS baseline is taken: its warm-up ramp is over by then
    (+4 MB in the first 25 s, then flat for 4 minutes without faults: docs/chaos.md), so what
    grows after it is what a leak would grow."""
    max_extension_s: float = 300.0
    """How much longer than ``duration`` the load may run when recoveries are slow, so that
    every fault of the schedule is injected and the phase after the last one lasts one interval
    (the report says ``extended_s``); 0: stop at ``duration`` and skip what does not fit."""
    recover_timeout_s: float = 120.0
    """Longest wait for a component to be ready again (and for the stack to start)."""
    out: Path | None = None
    """Report folder (default reports/chaos-<timestamp>/)."""
    min_success_ratio: float = 0.9995
    """Acceptance: successful calls / calls."""
    max_rotation_s: float = 3.0
    """Acceptance: longest a ready replica may wait to take traffic again."""
    max_rss_growth: float = 0.05
    """Acceptance: largest relative RSS growth of a gateway over the run."""
    max_hedge_ratio: float = 0.05
    """Acceptance: hedged TorchServe calls / TorchServe calls, all gateways together."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway (``gateway.schema`` names the model; port, backends and keys are set here)."""

    def check(self) -> None:
        """Raise ConfigError naming the first value that cannot work."""
        for name in self.schedule:
            if name not in FAULTS:
                raise rc.ConfigError(f"schedule: unknown fault {name!r}{suggest(name, list(FAULTS))}"
                                     f" (known: {', '.join(FAULTS)})")  # fmt: skip
        for key in ("users", "examples", "workers"):
            if getattr(self, key) < 1:
                raise rc.ConfigError(f"{key} = {getattr(self, key)}: must be >= 1")
        if self.max_extension_s < 0:
            raise rc.ConfigError(f"max_extension_s = {self.max_extension_s}: must be >= 0")
        for key in ("interval_s", "timeout_s", "pause_s", "recover_timeout_s"):
            if getattr(self, key) <= 0:
                raise rc.ConfigError(f"{key} = {getattr(self, key)}: must be > 0")
        if not 0 < self.min_success_ratio <= 1:
            raise rc.ConfigError(f"min_success_ratio = {self.min_success_ratio}: must be in (0, 1]")
        seconds(self.duration)


def start_cluster(cfg: ChaosConfig, out: Path) -> Cluster:
    """Replicas a and b (started together), then a gateway in front of both; stops what it
    started when something fails."""
    schema = Schema.load(cfg.gateway.schema)
    ts = resolve_model(TorchServeConfig(model_store=cfg.model_store, workers=cfg.workers,
                                        model_name=schema.model_name, model_version=schema.model_version))  # fmt: skip
    c = Cluster([], [], "", cfg.recover_timeout_s, cfg.pause_s, own_metrics_port)
    try:
        for name in "ab":
            r_cfg = on_free_ports(
                dataclasses.replace(ts, workdir=(out / f"replica-{name}").resolve())
            )
            c.replicas.append(Replica(name, r_cfg, process.start(r_cfg)))
        for r in c.replicas:
            process.wait_ready(r.cfg, cfg.recover_timeout_s, r.proc)
            _wait_workers(r, cfg)
        gw = dataclasses.replace(
            cfg.gateway, schema=cfg.gateway.schema.resolve(), host="127.0.0.1", port=free_ports(1)[0],
            backend=",".join(r.backend for r in c.replicas),
            key_file=",".join(str(r.cfg.key_file) for r in c.replicas),
        )  # fmt: skip
        c.gateways.append(start_gateway(own_metrics_port(gw), out, "a", cfg.recover_timeout_s))
        c.target = f"127.0.0.1:{gw.port}"
    except BaseException:
        stop_all(c)
        raise
    return c


def own_metrics_port(gw: GatewayConfig) -> GatewayConfig:
    """``gw`` with its metrics endpoint on a free port: two gateways run side by side here."""
    if gw.metrics.port == 0:
        return gw
    return dataclasses.replace(gw, metrics=dataclasses.replace(gw.metrics, port=free_ports(1)[0]))


def _wait_workers(r: Replica, cfg: ChaosConfig) -> None:
    end = time.monotonic() + cfg.recover_timeout_s
    while len(_ready_pids(r.cfg)) < cfg.workers:
        if time.monotonic() > end:
            raise RuntimeError(f"replica {r.name}: fewer than {cfg.workers} READY workers")
        time.sleep(0.2)


class Records:
    """The per-call records, read incrementally while Locust writes them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offsets: dict[Path, int] = {}
        self.calls: list[cr.Call] = []

    def poll(self) -> list[cr.Call]:
        for path in sorted(self.folder.glob("requests-*.csv")):
            with path.open() as f:
                f.seek(self.offsets.get(path, 0))
                text = f.read()
            whole = text[: text.rfind("\n") + 1]  # a line being written is read next time
            self.offsets[path] = self.offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                start, ms, code, backend = line.split(",")
                self.calls.append(cr.Call(float(start), float(ms), code, backend))
        return self.calls


class Sampler(threading.Thread):
    """Gateway RSS once a second until stopped."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.done = cluster, threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            sample_rss(self.cluster)


def _until(t: float, locust: threading.Thread) -> None:
    while time.time() < t and locust.is_alive():
        time.sleep(0.1)


def _back_in_rotation(
    records: Records, ev: Event, timeout: float, locust: threading.Thread
) -> None:
    """Block until a call answered by the event's replica succeeded after it was ready (or
    the load ended)."""
    end = time.monotonic() + timeout
    ready = ev.ready_at or 0.0
    while time.monotonic() < end and locust.is_alive():
        if any(c.ok and c.backend == ev.backend and c.end >= ready for c in records.poll()[-2000:]):
            return
        time.sleep(0.2)


def load_end(cfg: ChaosConfig, events: Sequence[Event], t0: float) -> float:
    """When the load stops: after ``duration``, and one interval after the last fault (a
    recovery that ran slow pushed the schedule later)."""
    return max([t0 + seconds(cfg.duration), *(e.at + cfg.interval_s for e in events[-1:])])


def inject(cfg: ChaosConfig, c: Cluster, records: Records, locust: threading.Thread, t0: float
           ) -> tuple[list[Event], list[tuple[str, str]]]:  # fmt: skip
    """Run the schedule against ``c`` while Locust runs: (events, skipped faults with why)."""
    events: list[Event] = []
    skipped: list[tuple[str, str]] = []
    last_start = t0 + seconds(cfg.duration) + cfg.max_extension_s - cfg.interval_s / 2
    turn = 0
    for k, name in enumerate(progress(cfg.schedule, desc="faults", unit="fault")):
        _until(t0 + (k + 1) * cfg.interval_s, locust)
        if not locust.is_alive() or time.time() > last_start:
            late = f"at {time.time() - t0:.0f} s too late in a {cfg.duration} run"
            skipped.append((name, f"{late} extended by at most {cfg.max_extension_s:g} s"))
            continue
        target = c.replicas[turn % len(c.replicas)]
        turn += name != "gateway-takeover"
        ev = FAULTS[name](c, target)
        events.append(ev)
        ready = "not ready" if ev.ready_at is None else f"ready in {ev.ready_at - ev.at:.1f} s"
        log.info(
            "t=%.1f s %s %s: %s; %s %s", ev.at - t0, name, ev.component, ev.detail, ready, ev.error
        )
        if ev.backend and ev.ready_at is not None:  # one component at a time
            _back_in_rotation(records, ev, cfg.recover_timeout_s, locust)
    return events, skipped


def run(cfg: ChaosConfig, out: Path) -> dict[str, Any]:
    """Start the stack, load it, inject the schedule, stop everything -> the report (also
    written to ``out``: report.json, chaos.png)."""
    assert cfg.data is not None
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests").mkdir(exist_ok=True)
    c = start_cluster(cfg, out)
    sampler = Sampler(c)
    try:
        sample_rss(c)
        sampler.start()
        longest = f"{seconds(cfg.duration) + cfg.max_extension_s:g}s"  # ended sooner: load_end
        load = LoadConfig(host=c.target, users=cfg.users, spawn_rate=float(cfg.users), duration=longest,
                          data=cfg.data, examples=cfg.examples, timeout_s=cfg.timeout_s)  # fmt: skip
        result: dict[str, Any] = {}

        def locust() -> None:
            try:
                result["locust"] = run_locust(load, c.target, cfg.users, longest, out / "locust", float(cfg.users),
                                              locustfile=LOCUSTFILE, env={LOG_ENV: str(out / "requests")})  # fmt: skip
            except (RuntimeError, OSError, ValueError) as e:
                result["error"] = e

        thread = threading.Thread(target=locust, daemon=True)
        thread.start()
        records = Records(out / "requests")
        while not records.poll() and thread.is_alive():  # the clock starts with the first call
            time.sleep(0.1)
        t0 = min((x.start for x in records.calls), default=time.time())
        c.gateways[0].primary_since = t0
        events, skipped = inject(cfg, c, records, thread, t0)
        _until(load_end(cfg, events, t0), thread)
        end_load()  # Locust's own clean quit: its CSVs and reports are written
        thread.join()
        sampler.done.set()
        sample_rss(c)
    finally:
        sampler.done.set()
        stop_all(c)
    if "error" in result:
        raise RuntimeError(f"locust: {result['error']}")
    return build_report(cfg, c, events, skipped, t0, out, result["locust"])


def build_report(cfg: ChaosConfig, c: Cluster, events: Sequence[Event], skipped: list[tuple[str, str]],
                 t0: float, out: Path, locust: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """report.json + chaos.png from what the run recorded."""
    calls = cr.read_calls(out / "requests")
    evs = [{"event": k + 1, **dataclasses.asdict(e)} for k, e in enumerate(events)]
    end = max((x.end for x in calls), default=t0)
    acceptance = {
        k: getattr(cfg, k)
        for k in ("min_success_ratio", "max_rotation_s", "max_rss_growth", "max_hedge_ratio")
    }
    report: dict[str, Any] = {
        "commit": git_commit(), "target": c.target, "duration_s": round(end - t0, 1),
        "extended_s": round(max(0.0, end - t0 - seconds(cfg.duration)), 1),
        "backends": {r.backend: r.name for r in c.replicas},
        "ok_by_replica": {r.name: sum(x.ok and x.backend == r.backend for x in calls) for r in c.replicas},
        "overall": cr.stats(calls), "events": cr.recovery(calls, evs, t0, end),
        "phases": cr.phases(calls, evs, t0, end),
        "gateways": {g.name: {**cr.rss_growth(g.rss, g.primary_since + cfg.warmup_s), **g.counts} for g in c.gateways},
        "hedges": cr.hedges([g.counts for g in c.gateways]),
        "skipped": skipped, "locust": locust, "acceptance": acceptance,
        "config": rc.to_dict(cfg),
    }  # fmt: skip
    report["violations"] = cr.verdict(report, acceptance)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    cr.plot(calls, report, t0, out / "chaos.png",
            f"chaos: {cfg.users} users x {cfg.examples} examples, 2 replicas x {cfg.workers} workers")  # fmt: skip
    return report


def parse_args(argv: Sequence[str] | None = None) -> ChaosConfig:
    cfg = rc.parse(ChaosConfig, argv, "python -m loadtest.chaos", __doc__.split("\n\n")[0])
    cfg.check()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = parse_args(argv)
        Schema.load(cfg.gateway.schema)
        resolve_data(cfg, cfg.gateway.schema)
    except rc.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, KeyError, ValueError) as e:
        print(
            f"error: gateway.schema {cfg.gateway.schema}: {e} (run `make export` first)",
            file=sys.stderr,
        )
        return 2
    out = (cfg.out or ROOT / "reports" / time.strftime("chaos-%Y%m%d-%H%M%S")).resolve()
    try:
        report = run(cfg, out)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(cr.table(report))
    print(f"report: {out / 'report.json'}  plot: {out / 'chaos.png'}")
    for line in report["violations"]:
        print(f"acceptance: {line}", file=sys.stderr)
    return ACCEPTANCE_EXIT if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
