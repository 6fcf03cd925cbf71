"""What the KServe front door needs of the gateway's scorer, named once.

``ranker.Ranker`` provides it and ``kserve`` consumes it; neither imports the other for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterable

    import numpy as np

    from serving.gateway.backends import BackendPool
    from serving.gateway.coalesce import Arrays
    from serving.gateway.config import GatewayConfig
    from serving.gateway.featurelog import FeatureLog
    from serving.gateway.request_ids import RequestIds
    from serving.gateway.validate import Schema
    from serving.plan import Plan


class Scorer(Protocol):
    """The gateway's scoring path behind every front door."""

    cfg: GatewayConfig
    schema: Schema
    pool: BackendPool
    plan: Plan
    ids: RequestIds
    feature_log: FeatureLog | None

    def resolve(self, version: str) -> str: ...

    def logs(self, metadata: Iterable[tuple[str, Any]] | None) -> bool: ...

    async def score_arrays(
        self, arrays: Arrays, version: str, time_remaining: float | None, log: bool = True
    ) -> tuple[np.ndarray, str, str, str]: ...
