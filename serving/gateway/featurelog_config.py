"""The feature log's settings (``[gateway.feature_log]``), apart from the log itself: the
gateway's config imports them, and so does every client of ``serving.gateway.config`` (the
Locust image among them), which must not need ``prometheus_client`` (the log's metrics do)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recsys_stack.config import env_field

KEY_FILE_NAME = "request_id.key"


@dataclass
class FeatureLogConfig:
    """What the gateway logs for the closed loop (serving/gateway/featurelog.py, docs/online.md)."""

    enabled: bool = env_field("RECSYS_FEATURE_LOG", False)
    """Log every scored example of a sampled request (impressions) and accept ``Feedback``
    clicks; off: ``Feedback`` answers FAILED_PRECONDITION."""
    dir: str = env_field("RECSYS_FEATURE_LOG_DIR", "runs/serve/feature_log")
    """Folder of the log: ``impressions/`` and ``clicks/`` (files appear there by rename when
    complete), and the request-id key by default."""
    key_file: str = env_field("RECSYS_FEATURE_LOG_KEY_FILE", "")
    """Key of the request ids' MAC (every gateway of a stack needs the same one: a click may
    reach any of them); created 0600 when missing. Empty = ``<dir>/request_id.key``."""
    sample: float = 1.0
    """Fraction of requests whose examples are logged (by request, decided from its id: every
    gateway agrees). Clicks on requests outside the sample are accepted and not written."""
    max_file_bytes: int = 64 * 1024 * 1024
    """A log file closes once it holds this many bytes..."""
    max_file_age_s: float = 2.0
    """...or has been open this long (the joiner sees records within about this delay)."""
    max_files: int = 2000
    """Closed files kept per kind in the folder (every writer's); the oldest beyond it are
    deleted (counted: ``recsys_gateway_feature_log_files_deleted_total``). 0 = keep all."""
    queue_examples: int = 200_000
    """Examples waiting to be written at most; a request that does not fit is dropped from the
    log (counted), never waited for."""
    max_clicks: int = 1000
    """Clicks in one ``Feedback`` call at most (more: INVALID_ARGUMENT)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError("feature_log.sample must be in [0, 1]")
        if min(self.max_file_bytes, self.queue_examples, self.max_clicks) < 1:
            raise ValueError("feature_log: max_file_bytes, queue_examples, max_clicks >= 1")
        if self.max_file_age_s <= 0 or self.max_files < 0:
            raise ValueError("feature_log: max_file_age_s > 0, max_files >= 0 (0: keep all)")

    @property
    def key_path(self) -> Path:
        return Path(self.key_file) if self.key_file else Path(self.dir) / KEY_FILE_NAME
