"""``python -m serving.tools.deltas``: move the running stack to an embedding delta, or back.

``publish --record JSON`` appends the delta its record names (written by ``python -m
training.export.delta`` into ``<store>/deltas/<model>/<default version>/``) to that folder's
chain. First the record's gate, when it has one (the probabilities of what serves and of the
candidate on rows it never trained on): judged by the rollout's rules, its ``--margin``
(``--rollout-args``, parsed as the rollout parses them) and its refusal on rows the default
scores near chance on; refused, nothing moves (exit 1, ``"refused": "gate"``). Then every
worker's ack from its start: one that takes no delta (fp16/fp32 tables, TorchScript, CUDA) or
serves tables of another format refuses it before the pointer moves. Then the pointer
(``current.json``) is replaced by rename under its lock (the chain must still end at the
delta's parent), every worker picks it up within ~0.2 s, builds the new version beside the old
and swaps it in whole (serving/worker/deltas.py), then says so in ``acks/<pid>.json``, naming the
pointer's write time and the chain's last file and sha256: only acks of this pointer count
(one written before it moved never does). The command waits until each worker TorchServe lists
on each replica (management API) acknowledges it: ``served_s`` is that wait. A worker that
refuses the delta (its own error is reported: format, checksum, base, order) keeps the old
version, and the pointer is put back; so it is when one does not answer in ``--timeout-s``.
With ``--dwell-s`` > 0 the error gate then watches the gateway's counters of the served
version for that long: more than ``--max-error-ratio`` non-OK calls (or too few calls to tell,
``--error-min-requests``) and the chain goes back one delta. ``rollback`` drops the last delta
(workers keep the last chains built: a swap, no I/O). Prints one JSON record (also on an error:
``promoted`` false and the ``reason``). ``lines``: one such command per stdin line, a record
per stdout line (:func:`serve_lines`: the continuous loop's warm publisher).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recsys_model.delta import update_pointer
from recsys_stack.config import ConfigError, parse
from serving import plan as plan_io
from serving.gateway.config import ChannelConfig
from serving.tools import canary
from serving.tools import evaluate as ev
from serving.tools.rollout import RolloutConfig
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


def answered(ack: dict[str, Any], pointer: dict[str, Any]) -> bool:
    """Whether ``ack`` answers ``pointer`` (or a later one): its pointer time is not older. An
    ack written before the pointer moved says nothing of it, whatever label it names."""
    return ack.get("deltas") is not False and float(ack.get("pointer_time") or 0) >= float(
        pointer.get("time", 0)
    )


def serves(ack: dict[str, Any], pointer: dict[str, Any]) -> bool:
    """Whether ``ack`` says its worker serves ``pointer``'s chain (its last file and sha256)."""
    last = pointer["chain"][-1] if pointer["chain"] else {"file": "", "sha256": ""}
    return (answered(ack, pointer) and not ack.get("error")
            and (ack.get("file"), ack.get("sha256")) == (last["file"], last["sha256"]))  # fmt: skip


def wait_served(
    folder: Path, pointer: dict[str, Any], pids: Sequence[int], timeout: float
) -> tuple[float, float]:
    """(seconds until every one of ``pids`` acknowledges serving ``pointer`` (:func:`serves`),
    the last ack's own time); raises RolloutError with a worker's own error when it refuses it
    (an ack of this pointer with an error) or takes no delta at all, or on timeout."""
    label = pointer["chain"][-1]["version"] if pointer["chain"] else ""
    t0 = time.monotonic()
    while True:
        seen = acks(folder, pids)
        if all(serves(seen.get(p, {}), pointer) for p in pids):
            last = max((float(seen[p].get("time") or 0) for p in pids), default=0.0)
            return time.monotonic() - t0, last or time.time()
        for pid, ack in seen.items():
            if ack.get("deltas") is False or (answered(ack, pointer) and ack.get("error")):
                raise RolloutError(f"worker {pid} refused {label or 'the base'}: {ack['error']}")
        if time.monotonic() - t0 > timeout:
            late = [p for p in pids if not serves(seen.get(p, {}), pointer)]
            raise RolloutError(f"workers {late} do not acknowledge {label or 'the base'!r} "
                               f"after {timeout:g} s")  # fmt: skip
        time.sleep(0.05)


Change = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def move(folder: Path, change: Change, pids: Sequence[int], timeout: float) -> dict[str, Any]:
    """Point ``folder`` at ``change(its chain)`` (under the pointer's lock) and wait until
    every worker serves it. On a refusal or timeout the old chain is put back (unless another
    moved the pointer meanwhile) and waited for by the workers that had answered (the others
    never left it), and RolloutError raised with the first error."""
    if not pids:
        raise RolloutError(f"{folder}: no worker of this version is running")
    old, pointer = update_pointer(folder, change)
    label = pointer["version"]
    try:
        served, acked_at = wait_served(folder, pointer, pids, timeout)
    except RolloutError as e:
        moved = [p for p, ack in acks(folder, pids).items() if answered(ack, pointer)]
        _, back = update_pointer(folder, lambda now: old if now == pointer["chain"] else now)
        where = back["version"] or "the base"
        try:
            wait_served(folder, back, moved, timeout)
        except RolloutError as again:
            raise RolloutError(f"{e}; the pointer is back on {where}, but {again}") from None
        raise RolloutError(f"{e}; back to {where}") from None
    return {"version": label, "pointer_time": pointer["time"], "served_s": round(served, 3),
            "acked_at": acked_at, "workers": len(pids)}  # fmt: skip


def append(entry: dict[str, Any]) -> Change:
    """The change that appends ``entry`` to a chain ending at its parent (else RolloutError:
    the pointer moved after the delta was made, which its workers would refuse)."""

    def change(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
        end = chain[-1]["version"] if chain else ""
        if entry.get("parent", end) != end:
            raise RolloutError(f"{entry['file']} follows {entry['parent']!r} but the chain ends "
                               f"at {end!r} (it moved since the delta was made): make it again")  # fmt: skip
        return [*chain, entry]

    return change


def check_workers(folder: Path, pids: Sequence[int], fmt: str | None) -> None:
    """RolloutError before the pointer moves when a worker's ack (written at its start) says
    it takes no delta or serves tables of another format than ``fmt``."""
    for pid, ack in acks(folder, pids).items():
        if ack.get("deltas") is False:
            raise RolloutError(f"worker {pid} takes no delta: {ack.get('error')}")
        if fmt and ack.get("format") and ack["format"] != fmt:
            raise RolloutError(f"worker {pid} serves {ack['format']} tables, the delta is of "
                               f"{fmt} rows: make it for {ack['format']}")  # fmt: skip


def judge(path: Path, rollout_args: Sequence[str]) -> dict[str, Any]:
    """The rollout's evaluated gate on the probabilities ``training.export.delta`` saved in
    ``path`` (``labels``, ``default``, ``candidate``): the same figures as a rollout's
    (serving.tools.evaluate), its margin (``rollout_args``, parsed as the rollout parses them)
    and its near-chance refusal (serving.tools.canary ``compare``)."""
    cfg = parse(RolloutConfig, list(rollout_args), "python -m serving.tools.rollout", "")
    with np.load(path) as z:
        y, now, cand = z["labels"], z["default"], z["candidate"]
    base, new = (ev.metrics(y, p, 10) for p in (now, cand))
    ok, table = canary.compare(base, new, cfg.margin)
    return {"passed": ok, "eval_rows": len(y), "margin": cfg.margin,
            "auc_default": base["auc"], "auc_candidate": new["auc"],
            "ne_default": base["normalized_entropy"], "ne_candidate": new["normalized_entropy"],
            "verdict": table.splitlines()[-1].strip()}  # fmt: skip


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
    t0 = time.perf_counter()
    stack = Stack.find(ChannelConfig(), a.workdir)
    folder, model, version = deltas_folder(stack)
    pids = worker_pids(stack, model, version)
    found_s = round(time.perf_counter() - t0, 3)  # the stack and its workers
    if a.command == "rollback":

        def drop(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
            if not chain:
                raise RolloutError(f"{folder}: no delta to roll back")
            return chain[:-1]

        return {"event": "delta_rollback", **move(folder, drop, pids, a.timeout_s)}
    entry = json.loads(a.record) if a.record else None
    if entry is None:
        raise RolloutError("publish needs --record (the JSON training.export.delta printed)")
    out: dict[str, Any] = {"event": "delta", "base": version, "version": entry["version"],
                           "found_s": found_s}  # fmt: skip
    judged = entry.pop("gate", None)
    if judged and judged.get("judge"):
        out["gate"] = judge(Path(judged["judge"]), json.loads(a.rollout_args))
        if not out["gate"]["passed"]:
            out.update(promoted=False, refused="gate",
                       reason=f"evaluated gate: {out['gate']['verdict']}")  # fmt: skip
            return out
    check_workers(folder, pids, entry.get("format"))
    out["judged_s"] = round(time.perf_counter() - t0 - found_s, 3)  # the gate, the acks
    out.update(move(folder, append(entry), pids, a.timeout_s))
    if a.dwell_s > 0:
        gw = Gateway(stack)
        try:
            why = error_gate(gw, version, a)
        finally:
            gw.close()
        if why:
            ours = entry["file"]
            move(folder, lambda now: now[:-1] if now and now[-1]["file"] == ours else now, pids,
                 a.timeout_s)  # fmt: skip
            out.update(promoted=False, reason=f"error gate: {why}; rolled back")
            return out
    out["promoted"] = True
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.tools.deltas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("command", choices=("publish", "rollback", "lines"))
    p.add_argument("--workdir", type=Path, default=WORKDIR, help="make serve's state folder")
    p.add_argument("--record", help="the delta's record (JSON, as training.export.delta prints)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--dwell-s", type=float, default=0.0, help="error gate window (0: off)")
    p.add_argument("--max-error-ratio", type=float, default=0.01)
    p.add_argument("--error-min-requests", type=int, default=20)
    p.add_argument(
        "--rollout-args",
        default="[]",
        help="JSON list: the rollout's arguments "
        'whose margin judges the delta\'s gate (e.g. \'["--margin", "0.01"]\')',
    )
    return p


def outcome(argv: Sequence[str]) -> dict[str, Any]:
    """The command's record for ``argv`` (``promoted`` false and the ``reason`` on an error):
    what it prints, for a caller in its own process (the continuous loop: no cold start)."""
    try:
        return run(parser().parse_args(argv))
    except (RolloutError, manage.ManageError, OSError, ValueError, ConfigError) as e:
        return {"event": "delta", "promoted": False, "reason": f"error: {e}"}


def serve_lines() -> int:
    """``python -m serving.tools.deltas lines``: one command's arguments per stdin line (a
    JSON list), its record printed as one line, until stdin closes. The continuous loop keeps
    one such process warm (imports done) so a publish pays no interpreter start."""
    for line in sys.stdin:
        try:
            argv = json.loads(line)
        except ValueError as e:
            print(json.dumps({"event": "delta", "promoted": False, "reason": f"error: {e}"}))
            continue
        print(json.dumps(outcome([str(a) for a in argv])), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["lines"]:
        return serve_lines()
    out = outcome(argv)
    if str(out.get("reason", "")).startswith("error: "):
        print(out["reason"], file=sys.stderr)
    print(json.dumps(out))
    return 0 if out.get("promoted", True) else 1


if __name__ == "__main__":
    sys.exit(main())
