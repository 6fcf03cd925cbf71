"""The hot-path counters and histograms (serving/gateway/tally.py) export exactly what
prometheus_client's own would for the same updates: names, labels, buckets, counts, sums."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway import tally


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")  # prometheus_client's creation times
    }


def test_the_same_updates_export_the_same_samples() -> None:
    rng = random.Random(7)
    bounds = [1.0, 2.0, 4.0, 8.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hot = tally.Tally(ours)
    pairs = [
        (tally.counter(hot, "c", "a counter", ["method", "code"]),
         Counter("c", "a counter", ["method", "code"], registry=theirs)),
        (tally.histogram(hot, "h", "by label", ["v"], buckets=bounds),
         Histogram("h", "by label", ["v"], buckets=bounds, registry=theirs)),
        (tally.histogram(hot, "lat", "default buckets", ["m"]),
         Histogram("lat", "default buckets", ["m"], registry=theirs)),
    ]  # fmt: skip
    plain = (tally.histogram(hot, "n", "no labels", buckets=bounds),
             Histogram("n", "no labels", buckets=bounds, registry=theirs))  # fmt: skip
    for _ in range(2000):
        for a, b in pairs:
            labels = [rng.choice("xyz") for _ in a.labelnames]
            if a.buckets is None:
                k = rng.randint(1, 3)
                a.labels(*labels).inc(k)
                b.labels(*labels).inc(k)
            else:  # on the bounds exactly (le: counted in that bucket), between, above all
                v = rng.choice([*bounds, 0.0, -1.0, 3.3, 100.0, rng.uniform(0, 12), 0.005, 0.3])
                a.labels(*labels).observe(v)
                b.labels(*labels).observe(v)
        v = rng.choice([*bounds, 0.5, 9.0])
        plain[0].observe(v)
        plain[1].observe(v)
    got, want = _samples(ours), _samples(theirs)
    assert set(got) == set(want)
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), (key, got[key], value)


def test_a_family_without_labels_is_exported_before_its_first_update() -> None:
    registry = CollectorRegistry()
    tally.histogram(tally.Tally(registry), "n", "no labels", buckets=[1.0])
    got = _samples(registry)
    assert got[("n_count", ())] == 0 and got[("n_bucket", (("le", "+Inf"),))] == 0
