"""``python -m serving.tools.deltas``: move the running stack to an embedding delta, or back.

``publish --record JSON`` appends the delta its record names (written by ``python -m training.export.delta`` into
``<store>/deltas/<model>/<default version>/``) to that folder's chain: the pointer
(``current.json``) is replaced by rename, every worker of every replica picks it up within
~0.2 s, builds the new version beside the old and swaps it in whole (serving/worker/deltas.py),
then says so in ``acks/<pid>.json``. The command waits until each worker TorchServe lists on
each replica (management API) acknowledges it: ``served_s`` is that wait. A worker that
refuses the delta (checksum, base, order) keeps the old version, and the pointer is put back.
With ``--dwell-s`` > 0 the error gate then watches the gateway's counters of the served
version for that long: more than ``--max-error-ratio`` non-OK calls (or too few calls to tell,
``--error-min-requests``) and the chain goes back one delta. ``rollback`` drops the last delta
(workers keep the last chains built: a swap, no I/O). Prints one JSON record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys_model.delta import read_pointer, write_pointer
from serving import plan as plan_io
from serving.gateway.config import ChannelConfig
from serving.tools.served import Gateway, RolloutError, Stack
from serving.tools.state import WORKDIR
from serving.torchserve import manage


def deltas_folder(stack: Stack) -> tuple[Path, str, str]:
    """(the default version's deltas folder, model, version) of the running stack."""
    plan = plan_io.load(stack.plan_file)
    store = Path(stack.replicas[0].model_store).resolve()
    return store / "deltas" / plan.model / plan.default, plan.model, plan.default


def worker_pids(stack: Stack, model: str, version: str) -> list[int]:
    """Every worker of ``model`` ``version`` on every replica, as TorchServe lists them."""
    pids = []
    for ts in stack.replicas:
        for entry in manage.describe(ts, model, version) or []:
            pids += [int(w["pid"]) for w in entry.get("workers", []) if w.get("pid")]
    return pids


def acks(folder: Path, pids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """What each of ``pids`` last said it serves (absent: nothing yet)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = json.loads((folder / "acks" / f"{pid}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def wait_served(folder: Path, label: str, pids: Sequence[int], timeout: float) -> float:
    """Seconds until every one of ``pids`` serves ``label``; raises RolloutError when one
    refuses it (its error) or on timeout."""
    t0 = time.monotonic()
    while True:
        seen = acks(folder, pids)
        if all(seen.get(p, {}).get("version") == label for p in pids):
            return time.monotonic() - t0
        errors = [a["error"] for a in seen.values() if a.get("error") and a["version"] != label]
        if errors and all(a.get("time", 0) > 0 for a in seen.values()):
            raise RolloutError(f"a worker refused {label or 'the base'}: {errors[0]}")
        if time.monotonic() - t0 > timeout:
            late = [p for p in pids if seen.get(p, {}).get("version") != label]
            raise RolloutError(f"workers {late} do not serve {label!r} after {timeout:g} s")
        time.sleep(0.05)


def move(
    folder: Path, chain: list[dict[str, Any]], pids: Sequence[int], timeout: float
) -> dict[str, Any]:
    """Point ``folder`` at ``chain`` and wait until every worker serves it; on a refusal or
    timeout the old chain is put back (and waited for) and RolloutError raised."""
    old = read_pointer(folder)["chain"]
    label = chain[-1]["version"] if chain else ""
    t0 = time.time()
    write_pointer(folder, chain)
    try:
        served = wait_served(folder, label, pids, timeout)
    except RolloutError as e:
        write_pointer(folder, old)
        wait_served(folder, old[-1]["version"] if old else "", pids, timeout)
        raise RolloutError(f"{e}; back to {old[-1]['version'] if old else 'the base'}") from None
    return {"version": label, "pointer_time": t0, "served_s": round(served, 3),
            "workers": len(pids)}  # fmt: skip


def error_gate(gw: Gateway, version: str, a: argparse.Namespace) -> str | None:
    """Why the served ``version`` failed the error gate over ``dwell_s`` (None: passed)."""
    start = gw.outcomes()
    time.sleep(a.dwell_s)
    now = gw.outcomes()
    if start is None or now is None:
        return "the error gate cannot judge: the gateway's metrics are off or unreachable"
    n = now.get(version, (0.0, 0.0))[0] - start.get(version, (0.0, 0.0))[0]
    e = now.get(version, (0.0, 0.0))[1] - start.get(version, (0.0, 0.0))[1]
    if n < a.error_min_requests:
        return f"{n:.0f} calls in {a.dwell_s:g} s: too few to judge ({a.error_min_requests})"
    if e / n > a.max_error_ratio:
        return f"{e:.0f} of {n:.0f} calls failed"
    return None


def run(a: argparse.Namespace) -> dict[str, Any]:
    stack = Stack.find(ChannelConfig(), a.workdir)
    folder, model, version = deltas_folder(stack)
    pids = worker_pids(stack, model, version)
    chain = read_pointer(folder)["chain"]
    if a.command == "rollback":
        if not chain:
            raise RolloutError(f"{folder}: no delta to roll back")
        return {"event": "delta_rollback", **move(folder, chain[:-1], pids, a.timeout_s)}
    entry = json.loads(a.record) if a.record else None
    if entry is None:
        raise RolloutError("publish needs --record (the JSON training.export.delta printed)")
    out = {"event": "delta", "base": version, **move(folder, [*chain, entry], pids, a.timeout_s)}
    if a.dwell_s > 0:
        gw = Gateway(stack)
        try:
            why = error_gate(gw, version, a)
        finally:
            gw.close()
        if why:
            move(folder, chain, pids, a.timeout_s)
            out.update(promoted=False, reason=f"error gate: {why}; rolled back")
            return out
    out["promoted"] = True
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.tools.deltas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("command", choices=("publish", "rollback"))
    p.add_argument("--workdir", type=Path, default=WORKDIR, help="make serve's state folder")
    p.add_argument("--record", help="the delta's record (JSON, as training.export.delta prints)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--dwell-s", type=float, default=0.0, help="error gate window (0: off)")
    p.add_argument("--max-error-ratio", type=float, default=0.01)
    p.add_argument("--error-min-requests", type=int, default=20)
    a = p.parse_args(argv)
    try:
        out = run(a)
    except (RolloutError, manage.ManageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0 if out.get("promoted", True) else 1


if __name__ == "__main__":
    sys.exit(main())
