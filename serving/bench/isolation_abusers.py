"""The isolation bench's abusers, each run in its own process (serving/bench/isolation_load.py)
as ``loops`` asyncio tasks that call back to back until told to stop.

Every outcome is counted by a short code: the gRPC status name (``OK``, ``RESOURCE_EXHAUSTED``,
``UNAUTHENTICATED``, ...), the HTTP status (``200``, ``400``, ``413``, ...), ``closed`` (the
server closed the connection), ``timeout`` (no answer within ``timeout_s``), or the exception's
type for a failure on this side (``ConnectionResetError``, ``SSLError``, ...).

* ``max-tenant``: another tenant (token B) sending valid requests of the largest size the
  gateway's limits allow (``limits.max_examples`` examples x ``limits.max_ids_per_feature``
  ids in every sparse feature), one TLS connection per loop;
* ``no-token``: the legitimate client's request with no token, one TLS connection per loop;
* ``idle-conns``: ``connections`` TLS connections (ALPN h2, handshake done, then nothing),
  each opened again when the server closes it or the open fails (after ``REOPEN_S``);
* ``metrics-scrape``: ``GET /metrics`` on the gateway's metrics port (token B as a bearer
  token: ignored where the endpoint is open), keep-alive connections;
* ``json-bomb``: ``POST /v2/models/<name>/infer`` over TLS with token B, a body of
  ``bomb_bytes`` of ``[{},{},...]`` (valid JSON, not a KServe request);
* ``malformed-http``: a new TLS connection per call to the REST port sending one of
  :data:`MALFORMED` in turn, read until the answer's first line or the connection's end;
* ``plaintext-tls``: a plaintext connection per call to the TLS gRPC port sending the HTTP/2
  preface and an empty SETTINGS frame, read until the server closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from serving.stubs import ranker_pb2


@dataclass
class Control:
    """How the bench steers an abuser: ``stop`` ends it; it calls ``ramped`` once at full
    strength (every loop started; every idle connection tried once)."""

    stop: asyncio.Event
    ramped: Callable[[], None]


SCORE = f"/{ranker_pb2.DESCRIPTOR.services_by_name['Ranker'].full_name}/Score"
REOPEN_S = 0.5  # an idle connection closed (or refused) is opened again after this
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
MALFORMED = (
    b"POST /v2/models/{m}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v2/models/{m}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v2/models/{m}/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nno colon in this header\r\n\r\n",
    b"\x16\x03\x01 GARBAGE \x00\xff / HTTP/9.9\r\n\r\n",
)


class Tally:
    """Outcomes by code, and the first message of each non-success code."""

    def __init__(self) -> None:
        self.codes: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def add(self, code: str, why: str = "") -> None:
        self.codes[code] += 1
        if why and code not in self.first:
            self.first[code] = why[:200]

    def error(self, e: BaseException) -> None:
        if isinstance(e, TimeoutError):
            self.add("timeout")
        elif isinstance(e, grpc.aio.AioRpcError):
            self.add(e.code().name, e.details() or "")
        else:
            self.add(type(e).__name__, str(e))

    def figures(self) -> dict[str, Any]:
        return {"calls": sum(self.codes.values()), "codes": dict(self.codes),
                "first_errors": self.first}  # fmt: skip


def tls_context(ca: str, alpn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols([alpn])
    return ctx


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """What the abuser sends, built before ``go`` (bodies, the open-files limit it needs)."""
    kind = spec["role"]
    out: dict[str, Any] = {}
    if kind in ("max-tenant", "no-token"):
        out["body"] = Path(spec["request"]).read_bytes()
    elif kind == "json-bomb":
        n = max(1, (spec["bomb_bytes"] - 2) // 3)  # "[" + "{}," * (n - 1) + "{}]"
        out["body"] = b"[" + b"{}," * (n - 1) + b"{}]"
    elif kind == "idle-conns":
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = spec["connections"] + 256
        if hard != resource.RLIM_INFINITY and hard < want:
            raise SystemExit(f"idle-conns needs {want} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return out


async def _loops(n: int, one: Callable[[Tally, int], Awaitable[None]], ctl: Control) -> Tally:
    """``n`` tasks (``one(tally, i)`` back to back in task ``i``) until ``stop``; calls cut short
    by the stop are not counted."""
    tally = Tally()

    async def loop(i: int) -> None:
        while not ctl.stop.is_set():  # (a cancel that asyncio.wait_for swallows ends it too)
            try:
                await one(tally, i)
            except Exception as e:  # every failure is an outcome: counted, and the loop goes on
                tally.error(e)
            await asyncio.sleep(0)  # a call that fails at once never starves the others

    tasks = [asyncio.create_task(loop(i)) for i in range(n)]
    ctl.ramped()
    await ctl.stop.wait()
    await _cancel(tasks)
    return tally


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=5)


async def grpc_calls(spec: dict[str, Any], body: bytes, token: str | None, ctl: Control) -> Tally:
    """``Score`` with ``body`` (bytes as they go on the wire), one TLS connection per loop."""
    creds = grpc.ssl_channel_credentials(Path(spec["ca"]).read_bytes())
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    channels = [
        grpc.aio.secure_channel(
            spec["target"], creds, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(spec["loops"])
    ]
    calls = [ch.unary_unary(SCORE) for ch in channels]

    async def one(tally: Tally, i: int) -> None:
        await calls[i](body, metadata=metadata, timeout=spec["timeout_s"])
        tally.add("OK")

    try:
        return await _loops(spec["loops"], one, ctl)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)


async def idle_conns(spec: dict[str, Any], ctl: Control) -> dict[str, Any]:
    """``connections`` idle TLS connections held (reopened when closed) until ``stop``."""
    ctx = tls_context(spec["ca"], "h2")
    host, port = spec["target"].rsplit(":", 1)
    handshakes = asyncio.Semaphore(128)
    tally = Tally()
    state = {"open": 0, "peak_open": 0, "tried": 0}

    def tried() -> None:
        state["tried"] += 1
        if state["tried"] == spec["connections"]:
            ctl.ramped()

    async def slot() -> None:
        while not ctl.stop.is_set():
            try:
                async with handshakes:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, int(port), ssl=ctx), spec["timeout_s"]
                    )
            except (OSError, TimeoutError, ssl.SSLError) as e:
                tally.error(e)
                tried()
                await asyncio.sleep(REOPEN_S)
                continue
            tally.add("opened")
            tried()
            state["open"] += 1
            state["peak_open"] = max(state["peak_open"], state["open"])
            try:
                while await reader.read(65536):  # the server's SETTINGS, if it sends them
                    pass
                tally.add("closed")
            except (OSError, ssl.SSLError) as e:
                tally.error(e)
            finally:
                state["open"] -= 1
                writer.close()
            await asyncio.sleep(REOPEN_S)

    tasks = [asyncio.create_task(slot()) for _ in range(spec["connections"])]
    await ctl.stop.wait()
    open_at_stop = state["open"]
    await _cancel(tasks)
    return {**tally.figures(), "peak_open": state["peak_open"], "open_at_stop": open_at_stop}


async def http_calls(spec: dict[str, Any], prepared: dict[str, Any], ctl: Control) -> Tally:
    """``metrics-scrape`` and ``json-bomb`` (aiohttp, keep-alive connections)."""
    auth = {"Authorization": f"Bearer {spec['token']}"}
    timeout = aiohttp.ClientTimeout(total=spec["timeout_s"])
    if spec["role"] == "metrics-scrape":
        url, body, ctx = f"http://127.0.0.1:{spec['metrics_port']}/metrics", None, None
    else:
        url = f"https://127.0.0.1:{spec['http_port']}/v2/models/{spec['model_name']}/infer"
        body, ctx = prepared["body"], tls_context(spec["ca"], "http/1.1")
        auth["Content-Type"] = "application/json"
    connector = aiohttp.TCPConnector(limit=spec["loops"], ssl=ctx if ctx else False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(tally: Tally, i: int) -> None:
            method = session.get if body is None else session.post
            async with method(url, data=body, headers=auth) as r:
                text = await r.read()
                tally.add(
                    str(r.status), "" if r.status < 300 else text[:200].decode(errors="replace")
                )

        return await _loops(spec["loops"], one, ctl)


async def raw_calls(spec: dict[str, Any], ctl: Control) -> Tally:
    """``malformed-http`` (TLS to the REST port) and ``plaintext-tls`` (TCP to gRPC's)."""
    host, port = spec["target"].rsplit(":", 1)
    malformed = spec["role"] == "malformed-http"
    ctx = tls_context(spec["ca"], "http/1.1") if malformed else None
    port = str(spec["http_port"]) if malformed else port
    sent = [0]

    async def one(tally: Tally, i: int) -> None:
        if malformed:
            data = MALFORMED[sent[0] % len(MALFORMED)].replace(b"{m}", spec["model_name"].encode())
        else:
            data = H2_PREFACE
        sent[0] += 1
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), ssl=ctx), spec["timeout_s"]
        )
        try:
            writer.write(data)
            await writer.drain()
            got = await asyncio.wait_for(reader.read(4096), spec["timeout_s"])
            if malformed and got.startswith(b"HTTP/"):
                tally.add(got.split(b" ", 2)[1].decode(errors="replace"))
            elif got and malformed:
                tally.add("not-http", repr(got[:80]))
            elif got:  # plaintext: the TLS server answered (an alert, or HTTP/2 frames)
                tally.add("answered-then-closed" if not await _drain(reader, spec) else "open")
            else:
                tally.add("closed")
        finally:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1)

    return await _loops(spec["loops"], one, ctl)


async def _drain(reader: asyncio.StreamReader, spec: dict[str, Any]) -> bool:
    """True when the connection is still open after ``timeout_s`` (read until then)."""
    try:
        while await asyncio.wait_for(reader.read(4096), spec["timeout_s"]):
            pass
    except TimeoutError:
        return True
    return False


async def run(spec: dict[str, Any], prepared: dict[str, Any], ctl: Control) -> dict[str, Any]:
    """The abuser ``spec["role"]`` until ``stop``; its figures."""
    kind = spec["role"]
    if kind == "max-tenant":
        return (await grpc_calls(spec, prepared["body"], spec["token"], ctl)).figures()
    if kind == "no-token":
        return (await grpc_calls(spec, prepared["body"], None, ctl)).figures()
    if kind == "idle-conns":
        return await idle_conns(spec, ctl)
    if kind in ("metrics-scrape", "json-bomb"):
        return (await http_calls(spec, prepared, ctl)).figures()
    if kind in ("malformed-http", "plaintext-tls"):
        return (await raw_calls(spec, ctl)).figures()
    raise ValueError(f"unknown abuser {kind!r}")
