"""TorchServe handler for the exported scorer: binary requests in, probabilities out.

TorchServe accepts a handler module with exactly one class, so the model-side stages live in
``serving/worker/scoring.py`` (archived beside this file) and only ``RecsysHandler`` is defined here.

Stages (LitServe-style, each testable without a server): ``load`` (artifact + schema, device
choice) -> ``decode`` each request (numpy arrays) -> ``merge`` them into one batch (the codec's,
as the gateway's coalescer merges) -> ``forward`` it -> ``split`` the scores back per request.
TorchServe's batching (``batch_size``, ``max_batch_delay``) hands ``handle`` several requests
of different sizes; they run as one forward. A malformed request fails alone (HTTP
400 with the reason) and never takes the worker or its batch-mates down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker
    from ts.torch_handler.base_handler import BaseHandler
except ImportError:  # pragma: no cover - unit tests without TorchServe
    BaseHandler = object  # type: ignore[misc,assignment]

try:  # TorchServe puts the archive's extra files beside the handler, not in a package
    from codec import DESCRIBE, REJECTION, CodecError, decode_json, encode_response, merge  # type: ignore[import-not-found]
    from delta import DELTA_FORMATS  # type: ignore[import-not-found]
    from deltas import DELTA_DIR_ENV, Deltas, folder_for, no_deltas  # type: ignore[import-not-found]
    from scoring import ScoringModel, choose_variant, to_tensors  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.delta import DELTA_FORMATS
    from serving.worker.codec import (
        DESCRIBE,
        REJECTION,
        CodecError,
        decode_json,
        encode_response,
        merge,
    )
    from serving.worker.deltas import DELTA_DIR_ENV, Deltas, folder_for, no_deltas
    from serving.worker.scoring import ScoringModel, choose_variant, to_tensors

logger = logging.getLogger(__name__)
RETUNE_S = 2.0  # how often a CPU worker recounts the replica's workers (a /proc scan: ~1 ms)


def choose_device(gpu_id: int | None, cuda_available: bool) -> torch.device:
    """``cuda:<gpu_id>`` when TorchServe assigned a GPU and CUDA works, else CPU."""
    if gpu_id is not None and cuda_available:
        return torch.device(f"cuda:{gpu_id}")
    return torch.device("cpu")


def cpu_threads(env: dict[str, str], cores: int, workers: int) -> int:
    """Intra-op threads per worker: RECSYS_THREADS, else the cores shared among the workers."""
    if env.get("RECSYS_THREADS"):
        return max(1, int(env["RECSYS_THREADS"]))
    return max(1, cores // max(workers, 1))


def replica_cpus() -> int:
    """The CPUs of this replica: ``RECSYS_CPUS`` (its cgroup quota, which the supervisor
    passes: serving/torchserve/process.py), else this machine's cores."""
    return int(os.environ.get("RECSYS_CPUS") or 0) or os.cpu_count() or 1


def replica_workers() -> int:
    """TorchServe workers on this replica, of every model and version: the processes sharing
    this worker's parent (the frontend) that run the worker script; 0 when /proc says nothing.
    While a rollout has two versions registered there are twice the workers of one.
    ``RECSYS_REPLICA_WORKERS``, when set, is the answer instead (serving/lite: each worker
    process is a replica of one)."""
    if os.environ.get("RECSYS_REPLICA_WORKERS"):
        return int(os.environ["RECSYS_REPLICA_WORKERS"])
    parent, count = os.getppid(), 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    count += (
                        b"model_service_worker" in Path(f"/proc/{entry.name}/cmdline").read_bytes()
                    )
    return count


class RecsysHandler(BaseHandler):  # type: ignore[misc,valid-type]
    """TorchServe entry point (``--handler serving/worker/handler.py``)."""

    on = torch.device("cpu")  # the device this worker scores on (BaseHandler owns .device)
    retuned_at = 0.0
    served: dict[str, str] = {}  # noqa: RUF012  set per instance by initialize
    deltas: Deltas | None = (
        None  # the delta chain over the mapped tables (serving/worker/deltas.py)
    )

    def initialize(self, context: Any) -> None:
        props = context.system_properties
        gpu_id = props.get("gpu_id")
        device = choose_device(None if gpu_id is None else int(gpu_id), torch.cuda.is_available())
        self.on, self.retuned_at = device, time.monotonic()
        if device.type == "cpu":
            workers = replica_workers() or int(os.environ.get("RECSYS_WORKERS", "1"))
            torch.set_num_threads(cpu_threads(dict(os.environ), replica_cpus(), workers))
        t0 = time.perf_counter()
        model_dir = Path(props["model_dir"])
        schema = json.loads((model_dir / "schema.json").read_text())
        variant, artifact, dtype = choose_variant(
            schema, context.manifest["model"]["serializedFile"], device, dict(os.environ)
        )
        self.scoring = ScoringModel(model_dir, artifact, device, dtype)
        self.variant = variant
        info = schema.get("variants", {}).get(variant, {})
        self.served = {
            "device": str(device), "variant": variant, "file": artifact,
            "dtype": str(dtype).removeprefix("torch.") if dtype else info.get("dtype", "fp32"),
        }  # fmt: skip
        mapped = info.get("kind") == "mapped" and info.get("file") == artifact
        self.deltas = self._deltas(context.manifest["model"], model_dir / artifact, mapped)
        load_s = time.perf_counter() - t0
        warm = os.environ.get("RECSYS_WARM_UP", "1") != "0"  # 0: skip (tests of startup)
        warm_s = self.scoring.warm_up() if warm else 0.0
        self.initialized = True
        logger.info(  # the load: the artifact (fbgemm imported for TorchRec's), tables mapped
            "recsys handler: variant %s (%s%s) on %s (%d threads), loaded in %.1f s, "
            "warmed up in %.1f s",
            variant, artifact, f", cast to {dtype}" if dtype else "", device,
            torch.get_num_threads(), load_s, warm_s,
        )  # fmt: skip

    def _deltas(self, manifest: dict[str, Any], artifact: Path, mapped: bool) -> Deltas | None:
        """With ``RECSYS_DELTA_DIR`` set and mapped int8/int4/mixed tables on CPU (``artifact``
        is a mapped variant's record, not a TorchScript file): this version's delta chain,
        applied now (a restarted worker comes up at the latest), then watched. Any other
        variant says in its ack that it takes no delta (serving/worker/deltas.py)."""
        root = os.environ.get(DELTA_DIR_ENV, "")
        if not root:
            return None
        name, version = manifest.get("modelName", ""), manifest.get("modelVersion", "")
        folder = folder_for(root, name, version)
        variant, device = self.served.get("variant"), self.served.get("device", "")
        if not mapped or variant not in DELTA_FORMATS or not device.startswith("cpu"):
            no_deltas(folder, f"this worker serves {variant} ({self.served.get('file')}) on "
                              f"{device}: no delta path, publish a full export")  # fmt: skip
            return None
        record = torch.load(artifact, map_location="cpu", weights_only=True)["tables"]
        deltas = Deltas(folder, self.scoring.model, version, record["sha256"], str(variant))
        deltas.poll()
        deltas.watch()
        return deltas

    def retune(self) -> None:
        """Every :data:`RETUNE_S`: the cores shared among the workers the replica runs now (a
        rollout registers a second version's workers beside these, then removes them)."""
        now = time.monotonic()
        if self.on.type != "cpu" or now - self.retuned_at < RETUNE_S:
            return
        self.retuned_at = now
        workers = replica_workers()
        threads = cpu_threads(dict(os.environ), replica_cpus(), workers)
        if workers and threads != torch.get_num_threads():
            logger.info("recsys handler: %d workers on this replica: %d threads", workers, threads)
            torch.set_num_threads(threads)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        """Decode each request (RSB1 bytes, or JSON ``instances``), one forward, split back.

        Every failure is its own request's: a body that does not decode (or a request the model
        raises on) gets the handler's rejection with its reason, its batch-mates still score."""
        self.retune()
        # the version this batch scores with, start to end (a delta swaps the next batch's)
        model = self.deltas.current if self.deltas else self.scoring.model
        decoded: list[Any] = []
        for i, row in enumerate(data):
            if DESCRIBE in row:  # the gateway asks what serves (once per replica and version)
                decoded.append(
                    json.dumps(
                        {
                            **self.served,
                            "threads": torch.get_num_threads(),
                            "workers": replica_workers(),
                            **(self.delta_state() if self.deltas else {}),
                        }
                    ).encode()
                )
                continue
            try:
                decoded.append(self._decode(row))
            except Exception as e:  # any failure here is this request's alone
                decoded.append(self._reject(context, i, e))
        good = [i for i, x in enumerate(decoded) if isinstance(x, tuple)]
        scored: dict[int, Any] = {}
        try:
            if good:
                parts = [decoded[i][0] for i in good]
                probs = self.scoring.forward(to_tensors(*merge(parts)), model)
                sizes = [len(p[0]) for p in parts]
                scored = dict(zip(good, torch.split(probs, sizes), strict=True))
        except Exception:  # find the request the model refuses: score each alone
            logger.warning("batch of %d failed; scoring its requests one by one", len(good))
            for i in good:
                try:
                    scored[i] = self.scoring.forward(to_tensors(*decoded[i][0]), model)
                except Exception as e:
                    decoded[i] = self._reject(context, i, e)
        out: list[Any] = []
        for i, x in enumerate(decoded):
            if isinstance(x, bytes):
                out.append(x)
            else:
                out.append(scored[i].tolist() if x[1] else encode_response(scored[i]))
        return out

    def delta_state(self) -> dict[str, Any]:
        """What the describe answer says of the delta chain: label ("": the base), error."""
        assert self.deltas is not None
        return {"delta": self.deltas.label, "delta_error": self.deltas.error}

    def _decode(self, row: dict[str, Any]) -> tuple[Any, bool]:
        """One request's body -> (its numpy arrays, whether it came as JSON)."""
        body = row.get("data") or row.get("body")
        if isinstance(body, bytes | bytearray) and body[:1] == b"{":
            try:
                body = json.loads(body)
            except ValueError as e:
                raise CodecError(f"body starts with '{{' but is not JSON: {e}") from None
        if isinstance(body, dict):
            names = self.scoring.dense_names, self.scoring.sparse_names
            return decode_json(body, *names), True
        if isinstance(body, bytes | bytearray):
            return self.scoring.decode(body), False
        raise CodecError(f"expected an RSB1 or JSON body, got {type(body).__name__}")

    @staticmethod
    def _reject(context: Any, idx: int, error: Exception) -> bytes:
        """Request ``idx`` fails with its reason (REST: 400 for a bad body, 500 otherwise)."""
        reason = str(error) if isinstance(error, CodecError) else f"{type(error).__name__}: {error}"
        context.set_response_status(400 if isinstance(error, ValueError) else 500, reason, idx=idx)
        return REJECTION + reason.encode()
