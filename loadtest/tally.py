"""What each Locust process writes as it quits: the end-of-run stats, and its own count of calls.

Locust's ``--csv`` files are rewritten once a second while it runs and not at its end: calls
that finished in the last second, or during the stop timeout, are missing from them (8-103 per
run, once a whole 6 s step). So at Locust's ``quit`` event, once its users stopped (and, in a
master, after the workers' last reports):

- the process that holds the stats (a local run, or the master) writes ``<prefix>_final.json``
  from Locust's own stats objects: successful and failed calls apart (:func:`final_stats`);
- each process that made calls (local, or a worker) writes ``<prefix>_load-<pid>.json``: its
  own count of calls and failures, when its first call started and its last one ended, and its
  working set (``loadtest/payload.py``): a check on what Locust counted, and the run's span.

The prefix is ``$LOADTEST_REPORT_PREFIX``, else Locust's ``--csv`` prefix (a worker has none:
without the variable it writes nothing). Successes and failures are apart because the user
reports a failed call under its own name (the method + :data:`FAILED`): each of Locust's
entries, percentiles included, then holds one kind of call only. Nothing here imports Locust at
import time: ``loadtest.report`` reads these files in processes that must not be gevent-patched.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recsys_model.atomic import write_atomic

PREFIX_ENV = "LOADTEST_REPORT_PREFIX"
FAILED = " (failed)"  # appended to a failed call's name in Locust's stats
FINAL = "_final.json"
LOAD = "_load-"


@dataclass
class Tally:
    """One load process's own count of the calls it made (what Locust should have counted)."""

    calls: int = 0
    failures: int = 0
    first_call_at: float | None = None  # unix s: the first call's start
    last_call_at: float | None = None  # unix s: the last call's end
    working_set: dict[str, Any] = field(default_factory=dict)

    def record(self, started: float, failed: bool) -> None:
        """One call that started at ``started`` (unix s) and ended now."""
        self.calls += 1
        self.failures += failed
        if self.first_call_at is None:
            self.first_call_at = started
        self.last_call_at = time.time()


def _figures(stats: Any, failed: bool) -> dict[str, Any]:
    """Locust's entries of one kind (failed or not) merged by Locust itself -> count and ms."""
    from locust.stats import StatsEntry

    e = StatsEntry(stats, "failed" if failed else "ok", "")
    for entry in stats.entries.values():
        if entry.name.endswith(FAILED) == failed:
            e.extend(entry)
    out: dict[str, Any] = {"requests": e.num_requests}
    if e.num_requests:  # Locust's percentiles: whole ms under 100 ms, 2 significant digits above
        out.update({f"p{p}_ms": e.get_response_time_percentile(p / 100) for p in (50, 95, 99)})
        low = e.min_response_time or 0
        out.update(max_ms=round(e.max_response_time, 3), min_ms=round(low, 3),
                   mean_ms=round(e.avg_response_time, 3))  # fmt: skip
    return out


def final_stats(stats: Any) -> dict[str, Any]:
    """Locust's ``RequestStats`` at the end of a run -> what ``<prefix>_final.json`` holds."""
    from locust.stats import StatsError

    total = stats.total
    span = (total.last_request_timestamp or total.start_time) - total.start_time
    return {
        "requests": total.num_requests,
        "failures": total.num_failures,
        "ok": _figures(stats, failed=False),
        "failed": _figures(stats, failed=True),
        "errors": [
            {"name": e.name, "error": StatsError.parse_error(e.error), "occurrences": e.occurrences}
            for e in stats.errors.values()
        ],
        "locust_span_s": round(span, 3),  # from Locust's stats start: the fallback span
        "written_at": round(time.time(), 3),
    }


def prefix(environment: Any) -> str | None:
    """Where this process's files go (see the module docstring), or None."""
    options = getattr(environment, "parsed_options", None)
    return os.environ.get(PREFIX_ENV) or getattr(options, "csv_prefix", None)


def _write(path: Path, doc: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(doc, indent=2) + "\n")  # whole or absent, never half


def write_final(environment: Any, where: str) -> None:
    """The end-of-run stats of the process that holds them (not a worker's: it has none)."""
    from locust.runners import WorkerRunner

    if not isinstance(environment.runner, WorkerRunner):
        _write(Path(where + FINAL), final_stats(environment.runner.stats))


def write_load(tally: Tally, where: str) -> None:
    """This load process's own count (only a process that built its requests made calls)."""
    if tally.working_set:
        _write(Path(f"{where}{LOAD}{os.getpid()}.json"), {"pid": os.getpid(), **asdict(tally)})
