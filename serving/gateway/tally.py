"""Counters and histograms for the event loop's hot path, exported by prometheus_client.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` take a lock per value and walk
a histogram's buckets in Python: the gateway's seven metric updates per ``Score`` call cost
10-19 us of its ~50-70 us of own code per call, in a loop (docs/bench.md). Here a counter
is a Python int and an observation one ``bisect`` and two additions, with no lock: every
update comes from the one event-loop thread. The scrape (prometheus_client's HTTP thread)
reads them through a :class:`Collector` registered in the same registry, so ``/metrics``
keeps the same names, labels and buckets (``_total``, ``_bucket``, ``_count``, ``_sum``).

A scrape copies a histogram's bucket list in one step (atomic under the GIL), so its buckets
and count always agree; its ``_sum`` may be one observation ahead or behind them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

# prometheus_client's default histogram buckets (seconds), +Inf implied
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """One observation: counted in the first bucket whose bound is >= it (``le``)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class Family:
    """A metric and its children by label values (``labels()``); one child when it has no
    labels (``inc`` / ``observe`` on the family itself)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
        registry: Collector | None = None,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.buckets = (
            None if buckets is None else tuple(float(b) for b in buckets if b != math.inf)
        )
        self.children: dict[tuple[str, ...], Any] = {}
        self._only = None if self.labelnames else self.labels()
        if isinstance(registry, Tally):
            registry.families.append(self)

    def labels(self, *values: str) -> Any:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = HistogramChild(self.buckets) if self.buckets is not None else CounterChild()
            self.children[values] = child
        return child

    def inc(self, amount: int = 1) -> None:
        self._only.inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float) -> None:
        self._only.observe(value)  # type: ignore[union-attr]

    def collect(self) -> Any:
        if self.buckets is None:
            family: Any = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
            for values, child in list(self.children.items()):
                family.add_metric(list(values), child.value)
            return family
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [*(_le(b) for b in self.buckets), "+Inf"]
        for values, child in list(self.children.items()):
            counts, total, running = list(child.counts), child.sum, 0
            cumulative = []
            for bound, n in zip(bounds, counts, strict=True):
                running += n
                cumulative.append((bound, running))
            family.add_metric(list(values), cumulative, total)
        return family


class Tally(Collector):
    """The hot-path families of one registry (``Family(..., registry=tally)``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.families: list[Family] = []
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        for f in self.families:
            yield f.collect()


def counter(tally: Tally, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family:
    """A counter exported as ``<name>_total``."""
    return Family(name, documentation, labelnames, registry=tally)


def histogram(
    tally: Tally,
    name: str,
    documentation: str,
    labelnames: Sequence[str] = (),
    buckets: Sequence[float] = DEFAULT_BUCKETS,
) -> Family:
    return Family(name, documentation, labelnames, buckets=buckets, registry=tally)


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (``1.0``, ``0.005``)."""
    return repr(float(bound))
