"""Callers without an accepted token, per peer address: a token bucket each, and a tarpit
past it (serving/gateway/auth.py refuses them; this decides how fast)."""

from __future__ import annotations

import asyncio
import time

MAX_PEERS = 65536  # peers whose buckets are kept before the full ones are forgotten


class PeerLimit:
    """A token bucket per peer address for calls without an accepted token.

    Within its bucket a peer's refusal is immediate (a client with a wrong token learns it at
    once); past it the refusal is answered after ``delay_s`` (a tarpit: 64 loops of such calls
    cut another client's calls by 54% when each was answered at once; a delayed answer holds a
    loop for ``delay_s``, so they make ~64 calls a second instead of thousands). At most
    ``max_delayed`` answers wait at once (more are answered at once: the tarpit cannot be made
    to hold memory)."""

    def __init__(self, rate: float, burst: float, delay_s: float, max_delayed: int = 4096) -> None:
        self.rate, self.burst, self.delay_s, self.max_delayed = rate, burst, delay_s, max_delayed
        self.buckets: dict[str, tuple[float, float]] = {}
        self.delayed = 0

    def allow(self, peer: str, now: float | None = None) -> bool:
        """Take a token of ``peer``'s bucket: False when it is empty."""
        now = time.monotonic() if now is None else now
        level, at = self.buckets.get(peer, (self.burst, now))
        level = min(self.burst, level + (now - at) * self.rate)
        ok = level >= 1.0
        self.buckets[peer] = (level - 1.0 if ok else level, now)
        if len(self.buckets) > MAX_PEERS:  # forget the peers whose buckets have refilled
            full = now - self.burst / self.rate if self.rate else now
            self.buckets = {p: v for p, v in self.buckets.items() if v[1] > full}
        return ok

    async def refuse(self, peer: str) -> str:
        """Wait as :class:`PeerLimit` says for a call of ``peer`` to be refused; "" when it is
        within its bucket, else the refusal's text."""
        if self.allow(peer):
            return ""
        if self.delayed < self.max_delayed and self.delay_s > 0:
            self.delayed += 1
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.delayed -= 1
        return (
            f"too many calls without an accepted token from {peer} (more than {self.rate:g} a "
            "second): send 'authorization: Bearer <token>' with a valid token"
        )


def peer_host(peer: str) -> str:
    """The address of a grpc ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) or an
    aiohttp ``request.remote``, without the port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, _ = rest.rpartition(":")
        return host.strip("[]") or rest
    return peer
