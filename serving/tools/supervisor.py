"""``make serve`` / ``make stop`` / ``make status``: TorchServe and the gateway in the background.

``python -m serving.tools.supervisor start`` (``recsys-serve start``) starts TorchServe with the
archive of the schema's model version, waits until a worker is READY, then starts the gateway
in front of it and returns once its health service says SERVING (or fails with the log tail,
stopping what it started). ``stop`` ends both (the gateway first, gracefully); ``status``
reports them. What ``start`` launched (pids, resolved configs) is recorded in
``<workdir>/serve.json``, so ``stop`` and ``status`` need nothing but the workdir. Each pid is
recorded with its identity (boot, start time, command line: ``process.identity``): after a
reboot or with a stale file the pid may belong to another process now, which ``stop`` never
signals (``gateway: not running (pid N is now another process)``); a pid recorded without one
(a serve.json of an older supervisor) that is alive is not signalled either: ``stop`` says how
to check it by hand and exits 1.

The gateway's ``backend`` and ``key_file`` are set from the TorchServe started here, and its
``auth.token_file`` defaults to ``<workdir>/gateway_token`` (created with a random token, mode
0600, kept across restarts and by ``stop``: ``make score`` and the load test read it); every
other key of the ``[gateway]`` and ``[torchserve]`` sections applies as in their own commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys_stack import verdict
from recsys_stack.config import (
    ArgumentParser,
    ConfigError,
    add_config_args,
    env_field,
    from_args,
    to_dict,
)
from recsys_stack.net import named_ports
from serving import plan as plan_io
from serving.gateway.auth import write_token_file
from serving.gateway.config import TOKEN_FILE_NAME, ChannelConfig, GatewayConfig
from serving.gateway.validate import Schema
from serving.plan import PLAN_FILE
from serving.tools.channel import for_gateway
from serving.tools.client import health
from serving.tools.recorded import recorded, replica_name, still_ours, survey
from serving.tools.restart_plan import plan_to_serve
from serving.tools.stack_status import status
from serving.tools.state import STATE, WORKDIR, WORKDIR_ENV, local_target, read_state, replicas
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, on_free_ports, resolve_model
from serving.torchserve.keys import write_inference_copy

GATEWAY_LOG = "gateway.log"


@dataclass
class ServeConfig:
    """TorchServe plus the gateway, started and stopped together."""

    workdir: Path = env_field(WORKDIR_ENV, WORKDIR)
    """State of the running stack: serve.json (pids, resolved configs) and the gateway's log;
    TorchServe's own state goes to torchserve.workdir, by default ``<workdir>/torchserve``."""
    timeout_s: float = 240.0
    """Longest wait for TorchServe's model, then for the gateway, to be ready."""
    replicas: int = 1
    """TorchServe replicas behind the gateway. The first uses [torchserve]'s ports and state
    folder; each further one gets free loopback ports and ``<workdir>/torchserve-<i>``."""
    torchserve: TorchServeConfig = field(default_factory=TorchServeConfig)
    """The TorchServe instance (model name/version default to the schema's)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway in front of it (backend and key_file are set from [torchserve]; its
    auth.token_file defaults to ``<workdir>/gateway_token``, created mode 0600 if missing)."""
    from_export: bool = False
    """Serve the export alone; off: the plan served last, when it can be (restart_plan.py)."""
    client: ChannelConfig = field(default_factory=ChannelConfig)
    """How ``start`` and ``status`` reach the gateway (``RECSYS_CLIENT_TLS_*``); with its TLS
    on, what is left empty comes from [gateway.tls] (serving/tools/channel.py ``for_gateway``)."""


class AlreadyRunning(RuntimeError):
    """``start`` found the processes of an earlier ``start`` alive."""


def as_overrides(cfg: Any) -> list[str]:
    """A config as ``section.key=value`` overrides that reproduce it on a command line."""

    def flat(table: dict[str, Any], prefix: str) -> list[str]:
        out = []
        for key, value in table.items():
            if isinstance(value, dict):
                out += flat(value, f"{prefix}{key}.")
            else:
                text = str(value).lower() if isinstance(value, bool) else value
                out.append(f"{prefix}{key}={text}")
        return out

    return flat(to_dict(cfg), "")


def launch_gateway(cfg: GatewayConfig, log: Path) -> subprocess.Popen[bytes]:
    """``python -m serving.gateway`` for ``cfg`` in its own session, its log.file ``log``."""
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, file=cfg.log.file or str(log)))
    with open(log, "ab") as out:  # what it writes before its log is set up (a bad flag)
        return subprocess.Popen(
            [sys.executable, "-m", "serving.gateway", *as_overrides(cfg)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def first_error(log: Path, offset: int = 0) -> str:
    """The first error line ``log`` holds past ``offset`` (``error: ...`` as the gateway prints
    it at start, else its first ERROR record, else its last line); "" when there is none."""
    try:
        with log.open("rb") as f:
            f.seek(offset if offset <= os.fstat(f.fileno()).st_size else 0)  # 0: it rotated
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    for pick in (lambda ln: ln.startswith("error: "), lambda ln: " ERROR " in ln):
        if found := next((ln for ln in lines if pick(ln)), None):
            return found.removeprefix("error: ")
    return lines[-1] if lines else ""


def wait_serving(
    target: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    channel: ChannelConfig | None = None,
    log: tuple[Path, int] | None = None,
) -> float:
    """Block until the gateway at ``target`` is SERVING (``channel``: TLS and token, None =
    plaintext); returns the seconds waited. A timeout names the last answer; an exit, the first
    error line of ``log`` (the gateway's log and where this start's output begins in it)."""
    t0 = time.monotonic()
    while (answer := health(target, channel=channel))[0] != "SERVING" or not said_serving(log):
        if proc.poll() is not None:
            why = first_error(*log) if log else ""
            raise RuntimeError(
                f"the gateway exited with code {proc.returncode}" + (f": {why}" if why else "")
            )
        if time.monotonic() - t0 > timeout:
            last = f"{answer[0]}: {answer[1]}" if answer[1] else answer[0]
            raise RuntimeError(
                f"the gateway at {target} was not SERVING after {timeout:.0f}s (last: {last})"
            )
        time.sleep(0.3)
    return time.monotonic() - t0


def said_serving(log: tuple[Path, int] | None) -> bool:
    """Our gateway's own log says SERVING since this start: a SERVING answer on the port may
    come from another process bound there (SO_REUSEPORT), while ours failed to bind and exited
    (a make demo beside the suite reported "serving" with no gateway of its own)."""
    if log is None:
        return True
    try:
        with log[0].open("rb") as f:
            f.seek(log[1])
            return b"gateway is SERVING" in f.read()
    except OSError:
        return False


def gateway_token_file(cfg: ServeConfig) -> Path:
    """``gateway.auth.token_file`` or ``<workdir>/gateway_token``, created (one random token,
    mode 0600) if missing; an existing file is kept, so clients holding its token keep working."""
    path = Path(cfg.gateway.auth.token_file or cfg.workdir / TOKEN_FILE_NAME).resolve()
    write_token_file(path)
    return path


# --- state ---------------------------------------------------------------------------------------


def _write_state(workdir: Path, **update: Any) -> None:
    state = read_state(workdir) | update
    (workdir / STATE).write_text(json.dumps(state, indent=2) + "\n")


# --- commands --------------------------------------------------------------------------------------
def replica_configs(cfg: ServeConfig, schema: Schema, plan_file: Path) -> list[TorchServeConfig]:
    """[torchserve] resolved for each replica: model from the schema, the plan file, and (past
    the first) free loopback ports (none the stack names) and a state folder of its own."""
    default_ts_dir = (
        cfg.torchserve.workdir == TorchServeConfig.__dataclass_fields__["workdir"].default
    )
    first = resolve_model(
        dataclasses.replace(
            cfg.torchserve,
            # TorchServe's state follows the stack's unless set on its own
            workdir=cfg.workdir / "torchserve" if default_ts_dir else cfg.torchserve.workdir,
            model_name=cfg.torchserve.model_name or schema.model_name,
            model_version=cfg.torchserve.model_version or schema.model_version,
            plan=str(plan_file),
        )
    )
    out, named = [first], named_ports(first, cfg.gateway, cfg.gateway.metrics)
    for i in range(1, cfg.replicas):  # the gateway binds its named ports later
        other = dataclasses.replace(first, workdir=first.workdir.with_name(replica_name(i)))
        out.append(on_free_ports(other, avoid=named))
    return out


def _identity(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """What is recorded beside a pid just started; a process whose identity cannot be read
    is stopped here (unrecorded, ``stop`` would not know it)."""
    try:
        return process.started_identity(proc)
    except RuntimeError:
        process.stop(proc, timeout=10)
        raise


def lost_to_baseline(mar: Path) -> str | None:
    """The warning of the archive ``mar``'s model when its training run recorded it losing
    to its linear baseline (:mod:`recsys_stack.verdict`); None otherwise or unreadable."""
    try:
        return verdict.schema_warning(plan_io.read_mar_schema(mar))
    except plan_io.PlanError:
        return None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def start(cfg: ServeConfig) -> str:
    """Start TorchServe (every replica), then the gateway; returns a one-line summary. Stops
    everything on failure. The serving plan starts with the schema's one version (its
    generation continues from the plan file's, if one is there)."""
    try:
        schema = Schema.load(cfg.gateway.schema)
    except (OSError, KeyError, ValueError) as e:
        raise FileNotFoundError(f"{cfg.gateway.schema}: {e} (run `make export` first)") from None
    alive, notes = survey(cfg.workdir)
    if alive or any(r.verdict() == "unverified" for r in recorded(cfg.workdir)):
        raise AlreadyRunning(
            f"already running ({cfg.workdir}); `make stop` first" + "".join(f"\n{n}" for n in notes)
        )
    if cfg.replicas < 1:
        raise ValueError(f"replicas = {cfg.replicas}: at least 1")
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    plan_file = (cfg.workdir / PLAN_FILE).resolve()
    reps = replica_configs(cfg, schema, plan_file)
    ts = reps[0]
    (cfg.workdir / STATE).unlink(missing_ok=True)
    try:
        served, note = plan_to_serve(
            plan_file, ts.model_store, ts.mar, (ts.model_name, ts.model_version), cfg.from_export
        )
        if note:
            say(note)
        lost = lost_to_baseline(ts.model_store / f"{served.model}-{served.default}.mar")
        if lost:  # served all the same (the user's choice), but never without a word
            say(f"WARNING: {lost}")
        # one generation past the plan a previous run left: generations only ever increase
        served = plan_io.update(plan_file, lambda _: served)
        t0 = time.monotonic()  # progress on stderr: the start takes 30-90 s on a busy machine
        say(f"starting TorchServe: {len(reps)} replica(s) of {served.model} v{served.default} "
            f"(state {ts.workdir})")  # fmt: skip
        started: list[dict[str, Any]] = []
        procs = []
        for r in reps:  # recorded one by one: a failed start stops those already started
            procs.append(process.start(r))
            pid = procs[-1].pid
            started.append({"pid": pid, "identity": _identity(procs[-1]),
                            "torchserve": to_dict(r)})  # fmt: skip
            _write_state(cfg.workdir, plan=str(plan_file), replicas=started)
        for r, p in zip(reps, procs, strict=True):
            process.wait_ready(r, cfg.timeout_s, p)
        say(f"TorchServe READY in {time.monotonic() - t0:.0f} s; starting the gateway")
        for r in reps:  # the gateway never opens the file holding the management key
            write_inference_copy(r.key_file, inference_copy(r))
        token_file = gateway_token_file(cfg)
        gw = dataclasses.replace(
            cfg.gateway,
            schema=cfg.gateway.schema.resolve(),
            plan=str(plan_file),
            backend=",".join(r.grpc_inference_target for r in reps),
            key_file=",".join(str(inference_copy(r).resolve()) for r in reps),
            backend_max_bytes=ts.max_request_bytes,
            auth=dataclasses.replace(cfg.gateway.auth, token_file=str(token_file)),
        )
        log = cfg.workdir / GATEWAY_LOG
        offset = log.stat().st_size if log.exists() else 0  # the log is appended to
        gateway = launch_gateway(gw, log)
        _write_state(cfg.workdir, gateway_pid=gateway.pid,
                     gateway_identity=_identity(gateway), gateway=to_dict(gw))  # fmt: skip
        channel = for_gateway(cfg.client, gw)
        wait_serving(local_target(gw), gateway, cfg.timeout_s, channel, (log, offset))
    except (OSError, RuntimeError, ValueError) as e:
        stop(cfg.workdir)
        raise RuntimeError(f"{e}\n(logs: {cfg.workdir}, {ts.workdir})") from None
    return (
        f"serving {served.model} v{served.default}: gateway {local_target(gw)}"
        f" (token {gw.auth.token_file}), TorchServe gRPC {gw.backend} (state {cfg.workdir}, plan"
        f" {plan_file})"
    )


def inference_copy(ts: TorchServeConfig) -> Path:
    """The copy of a replica's inference key the gateway reads (beside TorchServe's keys)."""
    return ts.key_file.with_name("inference_key.json")


@dataclass
class Stopped:
    """What ``stop`` did: the processes it ended, and a line for each it left alone."""

    names: list[str]
    notes: list[str]
    held: bool
    """A pid recorded without an identity is alive: nothing was signalled or removed (the
    state and key files stay, for whoever checks it by hand)."""


def stop(workdir: Path, timeout: float = 30.0) -> Stopped:
    """Stop the recorded gateway (SIGTERM: in-flight calls finish) and TorchServe's groups,
    each only while its pid is still the process ``start`` launched (boot, start time and
    command line as recorded): a pid that another process holds now is never signalled."""
    alive, notes = survey(workdir)
    if any(r.verdict() == "unverified" for r in recorded(workdir)):
        return Stopped([], notes, held=True)
    if "gateway" in alive and still_ours(workdir, "gateway"):
        pid = alive["gateway"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while process.group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.group_members(pid):  # its group: the id is not reused while it exists
            os.killpg(pid, signal.SIGKILL)
    for i, ts in enumerate(replicas(workdir)):
        if replica_name(i) in alive and still_ours(workdir, replica_name(i)):
            process.stop(alive[replica_name(i)], timeout=timeout)
        ts.key_file.unlink(missing_ok=True)
        inference_copy(ts).unlink(missing_ok=True)
    (workdir / STATE).unlink(missing_ok=True)
    return Stopped(sorted(alive), notes, held=False)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m serving.tools.supervisor",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("command", choices=["start", "stop", "status"])
    return add_config_args(p, ServeConfig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``recsys-serve start|stop|status``)."""
    ns = parser().parse_args(argv)
    try:
        cfg = from_args(ServeConfig, ns)
        if ns.command == "start":
            print(start(cfg))
            return 0
        if ns.command == "stop":
            done = stop(cfg.workdir, cfg.timeout_s)
            for note in done.notes:
                print(note)
            if done.held:
                return 1
            print(
                f"stopped {', '.join(done.names)}" if done.names else f"not running ({cfg.workdir})"
            )
            return 0
        code, report = status(cfg.workdir, cfg.client)
        print(report)
        return code
    except (ConfigError, AlreadyRunning, FileNotFoundError) as e:  # nothing was started
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
