"""Where the TorchServe replicas are: fixed addresses, or names resolved at every health round.

``backend`` lists entries, comma-separated:

* ``host:port``: one replica (gRPC resolves ``host`` itself; one channel, one backend).
* ``lite:PATH``: a lite worker's Unix socket on this machine (serving/lite: ``python -m
  serving.lite`` prints these), called over its own frames instead of gRPC.
* ``dns:///name:port`` (gRPC's naming form; ``dns:name:port`` too; port 7070 when left out):
  every address ``name`` resolves to is a replica. It is resolved again before each health
  round, so replicas a Deployment or ``docker compose --scale`` adds are probed and take calls
  within a round, and removed ones leave rotation and are closed once their calls end. A name
  that does not resolve keeps the addresses it had (a resolver hiccup is not an outage; the
  probes still say who answers).

``key_file`` gives each replica its TorchServe key file, comma-separated: one for all, one
per entry (an entry's addresses share it), or a template naming ``{host}`` (and ``{port}``),
filled from each address: ``/keys/{host}.json`` with replicas that each write their own
inference key under their address (docker/torchserve_entry.py, ``RECSYS_TS_INFERENCE_KEY_FILE``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.lite.frames import SCHEME, check_path

logger = logging.getLogger("serving.gateway.discovery")
DEFAULT_PORT = 7070  # TorchServe's gRPC inference port
TEMPLATE_FIELDS = ("{host}", "{port}")


@dataclass(frozen=True)
class Entry:
    """One entry of ``backend``."""

    text: str
    host: str
    port: int
    dns: bool


def _host_port(text: str, rest: str, default: int | None) -> tuple[str, int]:
    host, sep, port = rest.rpartition(":")
    if rest.startswith("[") and "]" in rest:  # [v6]:port or [v6]
        inside, _, after = rest[1:].partition("]")
        host, sep, port = inside, ":" if after.startswith(":") else "", after[1:]
    elif not sep or "]" in port:
        host, port = rest, ""
    if not host:
        raise ValueError(f"backend: '{text}' names no host (host:port or dns:///name:port)")
    if not port and default is not None:
        return host, default
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"backend: '{text}' needs a port 1-65535 (host:port or dns:///name:port)")
    return host, int(port)


def parse(backend: str) -> list[Entry]:
    """The entries of ``backend``; ValueError naming a malformed one."""
    entries = []
    for text in (t.strip() for t in backend.split(",")):
        if not text:
            continue
        if text.startswith(SCHEME):  # a lite worker's socket on this machine
            entries.append(Entry(text, check_path(text[len(SCHEME) :]), 0, dns=False))
        elif text.startswith("dns:"):
            rest = text[len("dns:") :]
            if rest.startswith("//"):  # dns://[authority]/name:port: the system's resolver only
                authority, slash, rest = rest[2:].partition("/")
                if authority or not slash:
                    raise ValueError(
                        f"backend: '{text}': no DNS authority is supported, write dns:///name:port"
                    )
            entries.append(Entry(text, *_host_port(text, rest, DEFAULT_PORT), dns=True))
        else:
            entries.append(Entry(text, *_host_port(text, text, None), dns=False))
    if not entries:
        raise ValueError("backend: no TorchServe address (host:port or dns:///name:port)")
    return entries


def address(host: str, port: int) -> str:
    """``host:port`` as gRPC dials it (``[v6]:port`` for IPv6)."""
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


class KeyFiles:
    """The key file of each replica (see the module's docstring)."""

    def __init__(self, key_file: str | Sequence[str | Path], n_entries: int) -> None:
        files = key_file.split(",") if isinstance(key_file, str) else key_file
        self.files = [str(f).strip() for f in files if str(f).strip()]
        self.template = any(f in p for p in self.files for f in TEMPLATE_FIELDS)
        if self.template and len(self.files) != 1:
            raise ValueError("key_file: a template ({host}, {port}) is the only key file")
        if len(self.files) not in (1, n_entries):
            raise ValueError(
                f"key_file: {len(self.files)} key files for {n_entries} backend entries: one, "
                "one per entry, or a template such as /keys/{host}.json"
            )

    def of(self, index: int, host: str, port: int) -> Path:
        """The key file of an address (``host``, ``port``) of entry ``index``."""
        path = self.files[0] if len(self.files) == 1 else self.files[index]
        return Path(path.format(host=host, port=port) if self.template else path)


class Discovery:
    """The replicas ``backend`` names now, each with its key file: ``(target, key file)``."""

    def __init__(self, backend: str | Sequence[str], key_file: str | Sequence[str | Path]) -> None:
        self.entries = parse(backend if isinstance(backend, str) else ",".join(backend))
        self.keys = KeyFiles(key_file, len(self.entries))
        self.dynamic = any(e.dns for e in self.entries)
        self._found: dict[int, list[tuple[str, int]]] = {}  # per dns entry: its last answer
        self._failing: set[int] = set()  # dns entries whose last lookup failed

    def fixed(self) -> list[tuple[str, Path]]:
        """The replicas known without resolving (entries that are not ``dns:``)."""
        return [self._pair(i, e.host, e.port) for i, e in enumerate(self.entries) if not e.dns]

    def _pair(self, index: int, host: str, port: int) -> tuple[str, Path]:
        entry = self.entries[index]
        target = entry.text if not entry.dns else address(host, port)
        return target, self.keys.of(index, host, port)

    async def resolve(self) -> list[tuple[str, Path]]:
        """Every replica now, in entry order, addresses sorted; a ``dns:`` name that does not
        resolve keeps its last answer (logged once per failure streak)."""
        out: dict[str, Path] = {}
        for i, entry in enumerate(self.entries):
            if not entry.dns:
                pairs = [(entry.host, entry.port)]
            else:
                pairs = await self._lookup(i, entry)
            for host, port in pairs:
                target, key = self._pair(i, host, port)
                out.setdefault(target, key)
        return list(out.items())

    async def _lookup(self, index: int, entry: Entry) -> list[tuple[str, int]]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                entry.host, entry.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
        except (OSError, UnicodeError) as e:  # socket.gaierror: no such name (yet), no resolver
            kept = self._found.get(index, [])
            if index not in self._failing:
                self._failing.add(index)
                logger.warning(
                    "%s does not resolve (%s): keeping its %d known replicas",
                    entry.text, e, len(kept),
                )  # fmt: skip
            return kept
        self._failing.discard(index)
        found = sorted({(str(info[4][0]), entry.port) for info in infos})
        self._found[index] = found
        return found
