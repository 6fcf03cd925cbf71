"""One client process of the isolation bench: the legitimate client, or one abuser.

``python -m serving.bench.isolation_load '<spec JSON>'`` (started by
:mod:`serving.bench.isolation`, one process per client so that no client's GIL distorts
another's timings). The process sets itself up (channels connected, one warm call each for the
legitimate client; payloads read), prints ``ready``, waits for ``go`` on stdin, then runs:

* ``legit``: ``loops`` threads, each with its own TLS connection and token A, calling
  ``Score`` back to back (closed loop) with the ``request`` file's body for ``seconds``;
  successful calls' latencies are kept, every other outcome counted by its gRPC code;
* an abuser (:mod:`serving.bench.isolation_abusers`): until ``stop`` (or EOF) on stdin.

Its last stdout line is one JSON object: the counts (``codes``: outcome -> calls), the first
message of each failure kind, its own CPU seconds, and the latencies (legit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from serving.bench import isolation_abusers
from serving.gateway.config import ChannelConfig
from serving.stubs import ranker_pb2
from serving.tools.channel import open_channel

ROOT = Path(__file__).resolve().parents[2]

# own connection per channel: grpc shares one between channels of the same target and options
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _line(expected: str) -> None:
    got = sys.stdin.readline().strip()
    if got != expected:
        raise SystemExit(f"expected {expected!r} on stdin, got {got!r}")


def legit(spec: dict[str, Any]) -> dict[str, Any]:
    """The legitimate client (module docstring); its figures."""
    body = Path(spec["request"]).read_bytes()
    examples = ranker_pb2.ScoreRequest.FromString(body).num_examples
    cfg = ChannelConfig(tls_ca=spec["ca"])
    # retries as our tools' channels make them (serving/tools/channel.py), unless turned off
    opts = [OWN_CONNECTION, *([] if spec["retries"] else [("grpc.enable_retries", 0)])]
    metadata = (("authorization", f"Bearer {spec['token']}"),)
    channels = [open_channel(spec["target"], cfg, opts) for _ in range(spec["loops"])]
    calls = [ch.unary_unary(isolation_abusers.SCORE) for ch in channels]
    deadline = time.monotonic() + 30
    for call in calls:  # connect and warm each, before the clock runs
        while True:
            try:
                call(body, metadata=metadata, timeout=spec["timeout_s"])
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    print("ready", flush=True)
    _line("go")
    cpu0 = _cpu_s()
    lock = threading.Lock()
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    first: dict[str, str] = {}
    end = time.monotonic() + spec["seconds"]

    def loop(call: Any) -> None:
        mine: list[float] = []
        got: Counter[str] = Counter()
        why: dict[str, str] = {}
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                reply = call(body, metadata=metadata, timeout=spec["timeout_s"])
            except grpc.RpcError as e:
                code = e.code().name  # type: ignore[attr-defined]
                got[code] += 1
                why.setdefault(code, f"{e.details()}"[:200])  # type: ignore[attr-defined]
                continue
            ms = (time.perf_counter() - t0) * 1e3
            if len(ranker_pb2.ScoreResponse.FromString(reply).scores) != examples:
                got["WRONG_ANSWER"] += 1
                continue
            got["OK"] += 1
            mine.append(ms)
        with lock:
            latencies.extend(mine)
            codes.update(got)
            for k, v in why.items():
                first.setdefault(k, v)

    threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ch in channels:
        ch.close()
    return {"calls": sum(codes.values()), "codes": dict(codes), "first_errors": first,
            "ok_ms": latencies, "cpu_s": _cpu_s() - cpu0}  # fmt: skip


def abuse(spec: dict[str, Any]) -> dict[str, Any]:
    """One abuser (:mod:`serving.bench.isolation_abusers`) from ``go`` to ``stop``."""
    prepared = isolation_abusers.prepare(spec)
    print("ready", flush=True)
    _line("go")
    cpu0 = _cpu_s()

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # a thread reads stdin: "stop" or EOF (the bench gone) ends the abuse
        threading.Thread(
            target=lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(stop.set)),
            daemon=True,
        ).start()
        ctl = isolation_abusers.Control(stop, ramped=lambda: print("ramped", flush=True))
        return await isolation_abusers.run(spec, prepared, ctl)

    out = asyncio.run(main())
    return {**out, "cpu_s": _cpu_s() - cpu0}


class Client:
    """One client process (serving/bench/isolation_load.py): ready -> go -> (stop) -> figures."""

    def __init__(self, spec: dict[str, Any], err: Path, stack: contextlib.ExitStack) -> None:
        self.err = err
        with err.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serving.bench.isolation_load", json.dumps(spec)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True,
            )  # fmt: skip
        stack.callback(self.kill)

    def wait_for(self, word: str, timeout: float, required: bool = True) -> bool:
        """Until the client prints ``word`` (``ready``: set up; ``ramped``: at full strength);
        False after ``timeout`` unless ``required`` (then RuntimeError)."""
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            if not required:
                return False
            raise RuntimeError(f"a client was not {word} after {timeout:.0f} s; see {self.err}")
        if self.proc.stdout.readline().strip() != word:
            raise RuntimeError(f"a client exited before it was {word}: {self._tail()}")
        return True

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def figures(self, timeout: float) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"a client did not end within {timeout:.0f} s: killed") from None
        lines = out.strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            raise RuntimeError(f"a client exited {self.proc.returncode}: {self._tail()}")
        return dict(json.loads(lines[-1]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _tail(self) -> str:
        return " | ".join(self.err.read_text(errors="replace").strip().splitlines()[-5:])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    spec = json.loads(args[0])
    out = legit(spec) if spec["role"] == "legit" else abuse(spec)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
