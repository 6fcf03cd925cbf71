"""The serving plan: which versions of a model are served, the default, and the traffic split.

The file's format, read and written here, below every serving process: the gateway, TorchServe's
config and the tools import it (the gateway's watcher of it is ``serving/gateway/plan_watcher.py``).

One JSON file (``<serve workdir>/plan.json``) is the source of truth that every part reads:

* ``make serve`` writes it with the run's version; ``make rollout`` / ``make rollback``
  rewrite it step by step (``serving/tools/rollout.py``);
* the gateway re-reads it when it changes (``GatewayConfig.plan``): versions it routes, the
  default for requests that name none, and the weights that split those requests;
* TorchServe's ``config.properties`` registers every version in it (``TorchServeConfig.plan``):
  a replica that restarts loads the versions the gateway expects, never just the newest .mar.

Every version of one model shares the request contract (dense and sparse feature names, in
order): clients do not change when the model does. A new feature set is a new model name.

Writes are atomic (a temporary file renamed over the old): a reader sees the old plan or the
new one, never half of one. ``generation`` grows by one with every write, across restarts too,
and writers never lose each other's updates: each write holds an exclusive lock
(``.plan.json.lock`` beside the file, ``flock``) while it reads the file's generation and
renames the new file in. :func:`save` is a compare-and-swap (the plan must be the next
generation of the one in the file: a rollout working from a plan someone else replaced since
stops with :class:`PlanConflict`); :func:`update` is a read-modify-write (``make serve`` starts
one generation past the file it finds). The gateway ignores a plan older than the one it
applied.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from recsys_model.atomic import write_atomic
from serving.gateway.watched import TRANSIENT

PLAN_FILE = "plan.json"


class Contract(Protocol):
    """A request contract: a plan's :class:`Version`, or the gateway's schema."""

    @property
    def dense(self) -> Sequence[str]: ...

    @property
    def sparse(self) -> Sequence[str]: ...


class PlanError(ValueError):
    """A plan file or a plan change that cannot be served; the message names the problem."""


class TransientPlanError(PlanError):
    """The plan file could not be read for a reason that says nothing of it (EMFILE, ENOMEM,
    EINTR, ...): its readers keep the plan they have and read it again."""


class PlanConflict(PlanError):
    """A write based on a plan that another writer has replaced since (a lost update)."""


@dataclass(frozen=True)
class Version:
    """One served version: its archive in the model store and its request contract."""

    mar: str
    dense: tuple[str, ...]
    sparse: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    model: str
    default: str
    versions: dict[str, Version]
    traffic: dict[str, float] = field(default_factory=dict)
    """Percent of the requests that name no version, per version (sums to 100); empty = all to
    ``default``. A version missing here gets none of them (it still serves calls naming it)."""
    previous: str = ""
    """The default before the last promotion: what ``make rollback`` returns to."""
    cordon: tuple[str, ...] = ()
    """Backends (the gateway's ``host:port`` targets) that get calls only when no other one
    is in rotation: a replica loading a new version, whose CPU is busy."""
    generation: int = 0

    @property
    def kept(self) -> str:
        """The previous default while it is still in the plan, kept loaded for rollback ("")."""
        prev = self.previous
        return prev if prev and prev != self.default and prev in self.versions else ""

    def __post_init__(self) -> None:
        if not self.model:
            raise PlanError("plan: no model name")
        if self.default not in self.versions:
            raise PlanError(
                f"plan: default version {self.default!r} is not among the versions "
                f"{sorted(self.versions)}"
            )
        first = self.versions[self.default]
        for v, entry in self.versions.items():
            if (entry.dense, entry.sparse) != (first.dense, first.sparse):
                raise PlanError(
                    f"plan: version {v!r} takes other features than the default "
                    f"{self.default!r} ({differing(first, entry, 'the default', v)}): every "
                    f"version of {self.model} must share the request contract (a new feature "
                    "set is a new model name)"
                )
        unknown = sorted(set(self.traffic) - set(self.versions))
        if unknown:
            raise PlanError(f"plan: traffic for versions not in the plan: {unknown}")
        if any(not (0 <= p <= 100) for p in self.traffic.values()):
            raise PlanError(f"plan: traffic shares must be percents in [0, 100]: {self.traffic}")
        if self.traffic and abs(sum(self.traffic.values()) - 100) > 1e-6:
            raise PlanError(f"plan: traffic shares add up to {sum(self.traffic.values())}, not 100")

    @property
    def dense(self) -> tuple[str, ...]:
        return self.versions[self.default].dense

    @property
    def sparse(self) -> tuple[str, ...]:
        return self.versions[self.default].sparse

    def shares(self) -> dict[str, float]:
        """Fraction of version-less requests per version (the default alone when no split)."""
        if not self.traffic:
            return {self.default: 1.0}
        return {v: p / 100 for v, p in self.traffic.items() if p > 0}

    def choose(self, ready: Callable[[str], bool], draw: float | None = None) -> str:
        """The version a request that names none goes to: drawn by the traffic shares among
        the versions ``ready`` (a canary not ready yet takes none of the traffic), else the
        default (whose calls then fail or fail over like any call)."""
        shares = self.shares()
        if len(shares) == 1:  # no traffic split: the one version, if ready
            (only,) = shares
            return only if ready(only) else self.default
        shares = {v: s for v, s in shares.items() if ready(v)}
        total = sum(shares.values())
        if not shares or total <= 0:
            return self.default
        x = (random.random() if draw is None else draw) * total
        for v, s in shares.items():
            x -= s
            if x < 0:
                return v
        return next(reversed(shares))

    def with_changes(self, **changes: Any) -> Plan:
        """A new plan (validated), one generation later."""
        return replace(self, generation=self.generation + 1, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "default": self.default,
            "previous": self.previous,
            "cordon": list(self.cordon),
            "generation": self.generation,
            "traffic": self.traffic,
            "versions": {
                v: {"mar": e.mar, "features": {"dense": list(e.dense), "sparse": list(e.sparse)}}
                for v, e in self.versions.items()
            },
        }

    @classmethod
    def from_json(cls, raw: Any, where: str = "plan") -> Plan:
        try:
            versions = {
                str(v): Version(
                    mar=str(e["mar"]),
                    dense=tuple(map(str, e["features"]["dense"])),
                    sparse=tuple(map(str, e["features"]["sparse"])),
                )
                for v, e in raw["versions"].items()
            }
            traffic = {str(v): float(p) for v, p in (raw.get("traffic") or {}).items()}
            return cls(
                model=str(raw["model"]),
                default=str(raw["default"]),
                versions=versions,
                traffic=traffic,
                previous=str(raw.get("previous", "")),
                cordon=tuple(map(str, raw.get("cordon") or ())),
                generation=int(raw.get("generation", 0)),
            )
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PlanError(
                f"{where}: not a serving plan ({type(e).__name__}: {e}); expected "
                '{"model", "default", "versions": {v: {"mar", "features": {"dense", "sparse"}}}}'
            ) from None


def load(path: Path) -> Plan:
    """The plan in ``path``; :class:`PlanError` naming the file when it is not one."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"{path}: no serving plan (`make serve` writes it)") from None
    except OSError as e:
        error = TransientPlanError if e.errno in TRANSIENT else PlanError
        raise error(f"{path}: unreadable serving plan: {e}") from None
    except ValueError as e:
        raise PlanError(f"{path}: unreadable serving plan: {e}") from None
    return Plan.from_json(raw, str(path))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """The plan file's write lock for the block (``flock`` on ``.<name>.lock`` beside it: one
    holder at a time across processes and threads; released when its descriptor closes, so a
    writer that dies holds nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def file_generation(path: Path) -> int | None:
    """The generation recorded in ``path`` (None: no file, or none readable in it)."""
    try:
        return int(json.loads(Path(path).read_text())["generation"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _replace(plan: Plan, path: Path) -> None:
    write_atomic(path, json.dumps(plan.to_json(), indent=2) + "\n")  # one writer: the lock


def save(plan: Plan, path: Path) -> None:
    """Write ``plan`` atomically (readers see the old file or the new one) if it is the next
    generation of the plan in the file (or the file has none): :class:`PlanConflict` when
    another writer got there first, whose update this write would undo."""
    path = Path(path)
    with locked(path):
        now = file_generation(path)
        if now is not None and plan.generation != now + 1:
            raise PlanConflict(
                f"{path}: plan {plan.generation} was made from plan {plan.generation - 1}, but "
                f"the file is at plan {now}: another writer (a rollout, `make serve`) changed "
                "it meanwhile; nothing written (`make status`, then run again)"
            )
        _replace(plan, path)


def update(path: Path, change: Callable[[Plan | None], Plan]) -> Plan:
    """Read-modify-write under the lock: ``change`` gets the plan in the file (None: no file,
    or not a plan) and returns the new one, written one generation past the file's (its own
    generation when the file has none); returns what was written."""
    path = Path(path)
    with locked(path):
        try:
            current: Plan | None = load(path)
        except PlanError:
            current = None
        new = change(current)
        now = file_generation(path)
        if now is not None:
            new = replace(new, generation=now + 1)
        _replace(new, path)
        return new


def version_from_schema(raw: dict[str, Any], mar: str) -> tuple[str, str, Version]:
    """``(model name, version, entry)`` from an export's ``schema.json`` contents."""
    try:
        name, version = str(raw["model"]["name"]), str(raw["model"]["version"])
        entry = Version(
            mar,
            tuple(map(str, raw["features"]["dense"])),
            tuple(map(str, raw["features"]["sparse"])),
        )
    except (KeyError, TypeError) as e:
        raise PlanError(f"{mar}: its schema.json lacks {e}") from None
    return name, version, entry


def read_mar_schema(mar: Path) -> dict[str, Any]:
    """The ``schema.json`` an archive carries (the handler's contract for that version)."""
    try:
        with zipfile.ZipFile(mar) as z:
            raw: dict[str, Any] = json.loads(z.read("schema.json"))
    except FileNotFoundError:
        raise PlanError(f"{mar} not found (export it first: `make export VERSION=...`)") from None
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise PlanError(f"{mar}: not a model archive with a schema.json ({e})") from None
    return raw


def single(schema: dict[str, Any], mar: str) -> Plan:
    """The plan of one version (what ``make serve`` starts with)."""
    name, version, entry = version_from_schema(schema, mar)
    return Plan(model=name, default=version, versions={version: entry})


def ordered(plan: Plan) -> Iterable[str]:
    """The plan's versions, default first (how metadata lists them)."""
    yield plan.default
    yield from (v for v in plan.versions if v != plan.default)


def differing(a: Contract, b: Contract, a_name: str, b_name: str) -> str:
    """The first difference between two request contracts, named: a feature one of them
    lacks, or the first position where their orders differ."""
    for kind in ("dense", "sparse"):
        fa, fb = getattr(a, kind), getattr(b, kind)
        for x, y, name, other in ((fa, fb, a_name, b_name), (fb, fa, b_name, a_name)):
            if only := [f for f in x if f not in y]:
                return f"{kind} feature {', '.join(only)}: in {name}'s, not in {other}'s"
        if fa != fb:
            i = next(i for i, (x, y) in enumerate(zip(fa, fb, strict=False)) if x != y)
            return f"{kind} features in another order: {fa[i]} vs {fb[i]} at position {i + 1}"
    return "the same features"
