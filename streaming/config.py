"""The joiner's one config (``python -m streaming.joiner --help``): defaults < ``--config
FILE.toml`` < environment < flags, through :mod:`recsys_stack.config` like every entry point.

Standard library only: the job imports it under ``.venv-flink``, the tests under ``.venv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recsys_stack.config import env_field

METRICS_PORT_ENV = "RECSYS_JOINER_METRICS_PORT"
METRICS_PORT = 9249  # Flink's Prometheus reporter's customary port


@dataclass
class JoinerConfig:
    """Where the logs come from, where the joined rows go, and the join's time rules."""

    logdir: Path = Path("runs/serve/feature_log")
    """The gateway's feature log: ``impressions/`` and ``clicks/`` below it hold the closed
    ``*.jsonl`` files (recsys_stack/online.py); hidden files (open ones) are never read."""
    out: Path = Path("runs/online/inbox")
    """The continuous loop's input folder (``make continuous DATA_DIR=``): complete TSV files
    ``joined-<ms>-<n>.tsv`` are renamed in, in natural name order. Nothing else goes there."""
    state: Path = Path("runs/online/joiner")
    """The job's own folder: Flink checkpoints (a restart resumes from the latest), the staging
    folder Flink's file sink commits into, the mover's state. Keep it across restarts."""
    manifest: Path | None = None
    """One JSON line per file renamed into ``out``: its name, rows, positives, its clicks'
    event times and when it was renamed in (default ``<state>/joined.jsonl``; never in ``out``:
    the loop would read it)."""
    window: float = 300.0
    """Seconds W: a label-1 click with event time in [impression, impression + W] makes the
    row positive; none by the time the watermark passes impression + W: 0."""
    early_positives: bool = False
    """Write a clicked row at its click instead of at its window's end: about W fresher, but a
    file then mixes the clicks of now with the non-clicks of a W ago (streaming/join.py: the
    model learns the join's timing; keep it off unless W is short against the traffic's drift)."""
    out_of_orderness: float = 5.0
    """Seconds the watermark trails the newest event time of each log (bounded disorder)."""
    idle_timeout: float = 10.0
    """Seconds without a new record after which a log stops holding the watermark back (no
    clicks for a while must not stall the impressions' windows)."""
    wall_close: float = 0.0
    """Seconds of wall time after an impression arrives after which its window closes even if
    the watermark never reached its end (all traffic stopped); also how long a closed key is
    kept when no watermark moves. 0 = W + out_of_orderness + idle_timeout + 30."""
    retention: float = 0.0
    """Seconds of event time a written row's key is kept after its window's end, to tell a late
    or a duplicate click from one without an impression. 0 = W."""
    min_rows: int = 256
    """Fewest rows in one output file (the loop rejects a file smaller than a training batch):
    rows wait in staging for the next file until there are this many."""
    checkpoint_interval: float = 5.0
    """Seconds between Flink checkpoints: rows reach ``out`` only after the checkpoint that
    covers them (exactly once), so this bounds the added latency."""
    monitor_interval: float = 1.0
    """Seconds between scans of the log folders for new files."""
    parallelism: int = 1
    """Flink's default parallelism (the sources, the join, the sink)."""
    metrics_port: int = env_field(METRICS_PORT_ENV, METRICS_PORT)
    """Flink's Prometheus reporter listens here (/metrics); 0 = no reporter."""
    python_executable: str = ""
    """The Python Flink's workers run the join in ("" = this interpreter, right for a local
    MiniCluster; on a cluster the one its task managers have PyFlink in)."""
    move_interval: float = 0.5
    """Seconds between the mover's scans of the staging folder."""

    def __post_init__(self) -> None:
        if min(self.window, self.monitor_interval, self.checkpoint_interval) <= 0:
            raise ValueError("window, monitor_interval and checkpoint_interval must be > 0 s")
        if min(self.out_of_orderness, self.idle_timeout, self.wall_close, self.retention) < 0:
            raise ValueError("out_of_orderness, idle_timeout, wall_close, retention must be >= 0")
        if self.min_rows < 1 or self.parallelism < 1:
            raise ValueError("min_rows and parallelism must be >= 1")

    @property
    def manifest_path(self) -> Path:
        return self.manifest if self.manifest is not None else self.state / "joined.jsonl"

    @property
    def wall_close_s(self) -> float:
        return self.wall_close or self.window + self.out_of_orderness + self.idle_timeout + 30.0

    @property
    def retention_s(self) -> float:
        return self.retention or self.window
