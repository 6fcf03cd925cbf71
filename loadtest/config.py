"""The load test's one config: a dataclass read by ``recsys_stack.config`` (TOML, env, flags).

``python -m loadtest.run`` and ``python -m loadtest.calibrate`` both take it, so a setting means
the same in both and is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys_stack.config import ConfigError, env_field

ROOT = Path(__file__).resolve().parents[1]
GATEWAY_ENV = "RECSYS_GATEWAY"
# Locust's own short options, kept for people who type them out of habit.
SHORT_FLAGS = {"users": "-u", "spawn_rate": "-r", "duration": "-t"}


@dataclass
class LoadConfig:
    host: str = env_field(GATEWAY_ENV, "127.0.0.1:50051")
    """Gateway host:port."""
    users: int = 4
    """Concurrent closed-loop users (no think time)."""
    spawn_rate: float = 4.0
    """Users started per second."""
    duration: str = "30s"
    """Locust run time, e.g. 10s, 2m."""
    data: Path | None = None
    """Criteo TSV for payloads (default: the file of the served model's unseen rows, as its
    schema.json records them, of the stack of ``workdir``; with nothing serving there, the
    newest data/synthetic/*.tsv, said in the output)."""
    workdir: Path = env_field("RECSYS_SERVE_DIR", Path("runs/serve"))
    """The running stack's state folder (``make serve``'s): whose served model's data is the
    default."""
    examples: int = 100
    """Examples per request."""
    sample_rows: int = 20_000
    """The working set: requests draw their rows from the whole data file when it holds no more
    rows than this, else from this many sampled across all of it (runs of 64 consecutive rows,
    one per equal slice of the file, at seeded offsets). summary.json's working_set says which."""
    seed: int = 0
    """Seed of the sample and of the requests built from it (the same in every load process)."""
    timeout_s: float = 5.0
    """Deadline of each call; a call past it counts as a failure (DEADLINE_EXCEEDED)."""
    processes: int = 1
    """Load processes; > 1: a Locust master that only aggregates plus this many workers."""
    out: Path | None = None
    """Report folder (default reports/<timestamp>/)."""
    slo_p99_ms: float | None = None
    """Exit 3 when the p99 latency is above this."""
    slo_failure_ratio: float = 0.01
    """Exit 3 when failed calls / calls is above this (1 = any share of failures passes); a step
    above it is never the knee."""
    step_users: list[int] = field(default_factory=list)
    """Step-load mode: user counts, one run each (e.g. 1,2,4,8); needs slo_p99_ms."""
    step_duration: str = "10s"
    """Run time of each step."""
    calibrate: bool = False
    """Measure the generator's ceiling against a no-op server first (adds a bottleneck verdict)."""
    generator_ceiling_rps: float | None = None
    """A ceiling measured before (python -m loadtest.calibrate), for the bottleneck verdict."""

    def check(self) -> None:
        """Raise ConfigError naming the first value that cannot work."""
        for name in ("users", "examples", "processes", "sample_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.spawn_rate <= 0 or self.timeout_s <= 0:
            raise ConfigError("spawn_rate and timeout_s must be > 0")
        if not 0 <= self.slo_failure_ratio <= 1:
            raise ConfigError(f"slo_failure_ratio = {self.slo_failure_ratio}: must be in [0, 1]")
        if self.sample_rows < self.examples:
            raise ConfigError(
                f"sample_rows = {self.sample_rows} < examples = {self.examples}: a request "
                "draws its rows from the working set; raise sample_rows or lower examples"
            )
        if any(u < 1 for u in self.step_users):
            raise ConfigError(f"step_users = {self.step_users}: user counts must be >= 1")
        if self.step_users and self.slo_p99_ms is None:
            raise ConfigError("step_users needs slo_p99_ms (the knee is the best step under it)")
        seconds(self.duration)
        seconds(self.step_duration)


def seconds(duration: str) -> float:
    """``"90"``, ``"10s"``, ``"2m"``, ``"1h"`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    d = duration.strip()
    try:
        return float(d[:-1]) * units[d[-1]] if d[-1] in units else float(d)
    except (ValueError, IndexError):
        raise ConfigError(f"duration {duration!r}: expected e.g. 30s, 2m") from None


def schema_data(schema: Path) -> tuple[Path, str]:
    """The file of the unseen rows ``schema`` (an export's schema.json) records; ConfigError
    (one line) when it records none, or they are missing."""
    import json

    from recsys_stack.datafile import DataMismatch
    from serving.tools.evaldata import model_window

    try:
        window = model_window(json.loads(schema.read_text()), str(schema.parent), 0)
    except (DataMismatch, OSError, ValueError) as e:
        raise ConfigError(f"{e}: pass --data FILE.tsv") from None
    return window.paths[-1], f"the model's data{window.origin}"


def resolve_data(cfg: Any, schema: Path | None = None) -> None:
    """``cfg.data`` (a :class:`LoadConfig` or the chaos run's config) when given, else :func:`schema_data` of ``schema`` or
    :func:`default_data`, said in one line."""
    if cfg.data is not None:
        return
    cfg.data, why = schema_data(schema) if schema is not None else default_data(cfg.workdir)
    print(f"load test rows from {cfg.data} ({why})", flush=True)


def default_data(workdir: Path) -> tuple[Path, str]:
    """The data file a load test draws from when none is given, and why: the file holding the
    served model's unseen rows (its own data: a model trained on other ids or another table
    size would be measured on rows it never meets), else the newest data/synthetic/*.tsv (a
    load test with nothing served from ``workdir`` still runs; the result says which file)."""
    from serving.tools.evaldata import NoDefault, default_window

    try:
        window = default_window(workdir, "", 0, "--data")
        return window.paths[-1], f"the served model's data{window.origin}"
    except NoDefault as served:
        found = sorted((ROOT / "data" / "synthetic").glob("*.tsv"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(f"{served}") from None
        return found[-1], f"the newest synthetic file (no served model's data: {served})"
