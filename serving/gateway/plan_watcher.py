"""The gateway's view of the serving plan (``serving/plan.py``): re-read when the file changes,
checked against the schema this gateway was started with, or made from that schema alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from recsys_stack.logs import OncePer
from serving.gateway.watched import WatchedFile
from serving.plan import Plan, PlanError, TransientPlanError, Version, differing, load

if TYPE_CHECKING:  # the gateway's schema (validate imports numpy; the plan's users need not)
    from serving.gateway.validate import Schema

logger = logging.getLogger("serving.gateway.plan")


class PlanWatcher:
    """Re-reads the serving plan file when it changes (serving/gateway/watched.py: inode,
    size, times and content); a plan that cannot be served here (unreadable, another model,
    another request contract, a generation older than the one applied) is logged once and the
    gateway keeps the plan it has."""

    def __init__(self, path: Path, schema: Schema) -> None:
        self.path = path
        self.schema = schema
        self._file = WatchedFile(path)
        self._transient_log = OncePer()
        self.generation: int | None = None
        """Generation of the last plan :meth:`load` returned (the one applied)."""

    def check(self, p: Plan) -> Plan:
        restart = "(start the gateway with the schema.json of the plan's model)"
        if p.model != self.schema.model_name:
            raise PlanError(
                f"{self.path}: plans model {p.model}, but this gateway was started for "
                f"{self.schema.model_name} {restart}"
            )
        if (p.dense, p.sparse) != (self.schema.dense, self.schema.sparse):
            why = differing(p.versions[p.default], self.schema, "the plan", "the gateway schema")
            raise PlanError(
                f"{self.path}: {p.model}'s request contract differs from this gateway's: "
                f"{why} {restart}"
            )
        return p

    def load(self) -> Plan:
        """The plan now in the file, checked for this gateway (:class:`PlanError` if it cannot
        be served); :meth:`poll` returns nothing new until the file changes again."""
        self._file.mark()  # before reading: a write meanwhile is seen by the next poll
        p = self.check(load(self.path))
        if self.generation is not None and p.generation < self.generation:
            raise PlanError(
                f"{self.path}: plan {p.generation} is older than plan {self.generation}, "
                "applied already (a stale write)"
            )
        self.generation = p.generation
        return p

    def poll(self) -> Plan | None:
        """The plan if the file changed since the last load (first call: always), else None."""
        if not self._file.changed():
            return None
        try:
            return self.load()
        except TransientPlanError as e:  # not the file's fault: read it again next poll
            self._file.forget()
            if self._transient_log.ready() is not None:
                logger.warning("%s; still serving the plan loaded before, reading it again", e)
            return None
        except PlanError as e:
            logger.error("%s; still serving the plan loaded before", e)
            return None


def schema_plan(schema: Schema) -> Plan:
    """The one-version plan of a schema (a gateway started without a plan file)."""
    entry = Version("", schema.dense, schema.sparse)
    return Plan(schema.model_name, schema.model_version, {schema.model_version: entry})
