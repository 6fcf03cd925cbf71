"""What ``make serve`` serves: the plan it served last, not whatever the last export is.

A rollout's gate refuses a bad candidate and keeps the default; before, ``make stop`` then
``make serve`` served the run's last export anyway (a v2 the gate had refused twice), as the
only version (nothing to roll back to), and rolling out the better v3 was then judged against
that bad default. Now the serving plan a stack leaves behind is what the next start serves, as
long as it is the same model, its archives are in the model store and it shares the export's
request contract: its default, its other versions (kept for rollback), its traffic shares. The
export is served alone only when there is no such plan, or when asked (``--from-export``, as
``make demo`` does for the model it has just trained); otherwise a line says which version the
export is and how to roll it out.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from serving import plan as plan_io
from serving.plan import Plan


def plan_to_serve(
    plan_file: Path, store: Path, mar: str, model: tuple[str, str], from_export: bool
) -> tuple[Plan, str]:
    """``(plan, note)``: the plan a start serves and a line for the operator ("" = none).
    ``mar`` is the export's archive in ``store``, which must hold ``model`` (name, version)."""
    export = plan_io.single(plan_io.read_mar_schema(store / mar), mar)
    if (export.model, export.default) != model:
        raise ValueError(f"{store / mar} holds {export.model} v{export.default}, not {model[0]} "
                         f"v{model[1]}")  # fmt: skip
    if from_export or not plan_file.is_file():
        return export, ""
    try:
        last = plan_io.load(plan_file)
    except plan_io.PlanError as e:
        return export, f"{e}: serving the export v{export.default} alone"
    if last.model != export.model:
        return export, ""  # another model: the export is what this start is for
    entry, first = export.versions[export.default], last.versions[last.default]
    if (entry.dense, entry.sparse) != (first.dense, first.sparse):
        return export, (
            f"the last plan's default v{last.default} takes other features than the export "
            f"v{export.default}: serving the export alone"
        )
    kept = {v: e for v, e in last.versions.items() if (store / e.mar).is_file()}
    if last.default not in kept:
        return export, (
            f"the last plan's default v{last.default} ({first.mar}) is no longer in {store}: "
            f"serving the export v{export.default} alone"
        )
    traffic = {v: p for v, p in last.traffic.items() if v in kept}
    if traffic and abs(sum(traffic.values()) - 100) > 1e-6:
        traffic = {}  # a share of a version gone: all requests to the default
    plan = replace(
        last,
        versions=kept,
        traffic=traffic,
        previous=last.previous if last.previous in kept else "",
        cordon=(),  # the replicas start anew: none is loading anything
    )
    gone = sorted(set(last.versions) - set(kept))
    notes = [f"serving the last plan: default v{plan.default}" + (
        f", also {', '.join('v' + v for v in plan.versions if v != plan.default)}"
        if len(plan.versions) > 1 else ""
    ) + (f" (v{', v'.join(gone)} no longer in {store})" if gone else "")]  # fmt: skip
    if export.default not in plan.versions:
        notes.append(
            f"the export v{export.default} is not served: `make rollout VERSION={export.default}` "
            "rolls it out behind the gate, or `make serve SERVE_ARGS=--from-export` serves it alone"
        )
    return plan, "; ".join(notes)
