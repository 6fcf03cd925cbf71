"""Per-tenant metrics, read at scrape time from the fair queue's flows (serving/gateway/fair.py).

Exported (prefix ``recsys_gateway_tenant_``), one series per tenant (the token file's tenants
and ``default``: the cardinality is the operator's):

- ``admitted_total{tenant}``: requests admitted to the backends.
- ``refused_total{tenant,reason}``: requests refused at the door (``door``: its queue and its
  calls still uploading hold a queue's worth), when its queue was full (``queue``), or whose
  deadline ran out before their turn or was shorter than the backends' latency (``deadline``).
- ``in_flight_examples{tenant}``, ``in_flight_ids{tenant}``, ``queued_requests{tenant}``: now.
- ``weight{tenant}``: its weight (its share is weight / the busy tenants' weights).
- ``queue_wait_seconds{tenant}``: histogram of the waits of requests that queued (those admitted
  at once are not observed: ``admitted_total`` minus its count).

Nothing here runs on the hot path: the flows keep plain numbers, this reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from serving.gateway.fair import WAIT_BUCKETS, FairQueue

PREFIX = "recsys_gateway_tenant"


class TenantCollector(Collector):
    """Reads ``fair``'s flows at each scrape."""

    def __init__(self, fair: FairQueue) -> None:
        self.fair = fair

    def collect(self) -> Iterator[Metric]:
        flows = list(self.fair.flows.values())  # one step under the GIL
        admitted = CounterMetricFamily(
            f"{PREFIX}_admitted", "requests admitted, by tenant", labels=["tenant"]
        )
        refused = CounterMetricFamily(
            f"{PREFIX}_refused", "requests refused, by tenant and reason",
            labels=["tenant", "reason"],
        )  # fmt: skip
        gauges = {
            "in_flight_examples": "examples being scored now",
            "in_flight_ids": "sparse ids being scored now",
            "queued_requests": "requests waiting for the tenant's share",
            "weight": "the tenant's weight (token file)",
        }
        families = {
            k: GaugeMetricFamily(f"{PREFIX}_{k}", h, labels=["tenant"]) for k, h in gauges.items()
        }
        waits = HistogramMetricFamily(
            f"{PREFIX}_queue_wait_seconds", "waits of queued requests for their share",
            labels=["tenant"],
        )  # fmt: skip
        bounds = [str(b) for b in WAIT_BUCKETS] + ["+Inf"]
        for f in flows:
            name = f.name
            admitted.add_metric([name], f.admitted)
            for reason, n in list(f.refused.items()):
                refused.add_metric([name, reason], n)
            families["in_flight_examples"].add_metric([name], f.examples)
            families["in_flight_ids"].add_metric([name], f.ids)
            families["queued_requests"].add_metric([name], len(f.queue))
            families["weight"].add_metric([name], f.tenant.weight)
            counts = list(accumulate(list(f.waits)))
            waits.add_metric([name], list(zip(bounds, counts, strict=True)), f.wait_sum)
        yield admitted
        yield refused
        yield from families.values()
        yield waits


def register(registry: CollectorRegistry, fair: FairQueue) -> None:
    """Export ``fair``'s per-tenant figures from ``registry``."""
    registry.register(TenantCollector(fair))
