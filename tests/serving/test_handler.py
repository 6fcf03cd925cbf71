"""The TorchServe handler's stages, in process, on a real exported artifact.

(The end-to-end test with a running TorchServe and the gateway belongs to the serving stage.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from serving.worker.codec import (
    REJECTION,
    CodecError,
    decode_json,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from serving.worker.handler import RecsysHandler, choose_device, cpu_threads
from serving.worker.scoring import ScoringModel, Tensors, slice_examples, to_tensors


def _sample(export: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    s = np.load(export / "sample.npz")
    return (torch.from_numpy(s["dense"]), torch.from_numpy(s["values"]),
            torch.from_numpy(s["lengths"]), s["probs_int8"])  # fmt: skip


def test_codec_round_trip() -> None:
    dense = torch.rand(3, 13)
    lengths = torch.tensor([[1, 0, 2]] * 26, dtype=torch.int32)
    values = torch.arange(78, dtype=torch.int64) * 7919
    body = encode_request(dense, values, lengths)  # torch in, numpy inside: the same bytes
    assert body == encode_request(dense.numpy(), values.numpy(), lengths.numpy())
    d, v, ln = to_tensors(*decode_request(body, 13, 26))
    assert torch.equal(d, dense) and torch.equal(v, values) and torch.equal(ln, lengths)
    p = torch.rand(3)
    assert np.array_equal(decode_response(encode_response(p)), p.numpy())


def test_rsb1_bytes_are_pinned() -> None:
    # The format is a contract between gateway and handler (docs/contracts.md): byte for byte.
    body = encode_request(np.array([[1.5, -2.0]]), np.array([7, 2**40]), np.array([[1], [1]]))
    assert body.hex() == (
        "52534231" "01000000" "02000000" "02000000" "02000000"  # RSB1, B=1, D=2, F=2, N=2
        "0000c03f" "000000c0"  # dense float32
        "01000000" "01000000"  # lengths int32 [F, B]
        "0700000000000000" "0000000000010000"  # ids int64
    )  # fmt: skip


def test_json_instances_decode_like_rsb1() -> None:
    names = [f"C{i}" for i in range(1, 27)]
    body = {"instances": [{"dense": [1.0] * 13, "sparse": {"C2": [5]}}, {"dense": [0.0] * 13}]}
    dense, values, lengths = decode_json(body, [f"I{i}" for i in range(1, 14)], names)
    assert dense.shape == (2, 13) and values.tolist() == [5]
    assert lengths[1].tolist() == [1, 0] and lengths.sum() == 1
    with pytest.raises(CodecError, match="unknown feature 'C99'"):
        decode_json({"instances": [{"dense": [0] * 13, "sparse": {"C99": [1]}}]}, ["I"] * 13, names)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "shorter than"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:-8], "needs"),
        (lambda b: b + b"\0", "needs"),
    ],
)
def test_codec_names_what_is_wrong(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    body = encode_request(torch.rand(2, 13), torch.arange(52), torch.ones(26, 2, dtype=torch.int32))
    with pytest.raises(CodecError, match=message):
        decode_request(mutate(body), 13, 26)


def test_codec_checks_schema_counts_and_lengths() -> None:
    with pytest.raises(CodecError, match="the model takes 13 and 26"):
        decode_request(
            encode_request(
                torch.rand(2, 12), torch.arange(52), torch.ones(26, 2, dtype=torch.int32)
            ),
            13,
            26,
        )
    lengths = torch.ones(26, 2, dtype=torch.int32)
    lengths[0, 0] = 2  # says 53 ids, body carries 52
    body = bytearray(encode_request(torch.rand(2, 13), torch.arange(53), lengths))
    with pytest.raises(CodecError, match="needs"):
        decode_request(bytes(body[:-8]), 13, 26)
    with pytest.raises(CodecError, match="0 examples"):
        decode_request(
            encode_request(
                torch.rand(0, 13), torch.arange(0), torch.ones(26, 0, dtype=torch.int32)
            ),
            13,
            26,
        )


def test_device_and_threads_choice() -> None:
    assert choose_device(0, cuda_available=True) == torch.device("cuda:0")
    assert choose_device(0, cuda_available=False) == torch.device("cpu")
    assert choose_device(None, cuda_available=True) == torch.device("cpu")
    assert cpu_threads({}, cores=8, workers=2) == 4
    assert cpu_threads({"RECSYS_THREADS": "3"}, cores=8, workers=2) == 3
    assert cpu_threads({}, cores=2, workers=4) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "cuts",
    [
        [(0, 1), (1, 8), (8, 108), (108, 600)],  # merged by slices (codec.SLICE_PARTS)
        [(k, k + 1) for k in range(10)] + [(10, 20), (20, 600)],  # by a sort of the ids
    ],
)
def test_batched_requests_of_different_sizes_score_like_separate_ones(
    exported: tuple[Path, Path, str], cuts: list[tuple[int, int]]
) -> None:
    """A TorchServe batch of requests is merged (the codec's merge), scored in one forward and
    split back: each request gets the scores it gets alone, and the export's."""
    export, _, _ = exported
    handler = _handler(ScoringModel(export, "mapped_int8.pt", torch.device("cpu")))
    dense, values, lengths, expected = _sample(export)
    bodies = [encode_request(*slice_examples(dense, values, lengths, lo, hi)) for lo, hi in cuts]
    context = _Context()
    outs = handler.handle([{"body": b} for b in bodies], context)
    assert context.status == {}
    for (lo, hi), body, out in zip(cuts, bodies, outs, strict=True):
        alone = handler.scoring.forward(to_tensors(*handler.scoring.decode(body)))
        assert alone.shape == (hi - lo,)
        np.testing.assert_allclose(decode_response(out), alone.numpy(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(alone.numpy(), expected[lo:hi], atol=1e-6, rtol=0)


class _Context:
    """What ``handle`` reads of TorchServe's context: the per-request status it sets."""

    def __init__(self) -> None:
        self.status: dict[int, tuple[int, str]] = {}

    def set_response_status(self, code: int, phrase: str, idx: int = 0) -> None:
        self.status[idx] = (code, phrase)


def _handler(scoring: ScoringModel) -> RecsysHandler:
    handler = RecsysHandler()
    handler.scoring = scoring
    return handler


@pytest.mark.slow
def test_a_poison_body_in_a_batch_fails_alone(exported: tuple[Path, Path, str]) -> None:
    export, _, _ = exported
    handler = _handler(ScoringModel(export, "mapped_int8.pt", torch.device("cpu")))
    dense, values, lengths, expected = _sample(export)
    names = handler.scoring.dense_names
    as_json = {"instances": [{"dense": dense[2].tolist(), "sparse": {}}]}
    bodies: list[object] = [
        b"{not json",  # first: a bad body must not shift the batch-mates' slots
        encode_request(*slice_examples(dense, values, lengths, 0, 2)),
        b'{"instances": [1]}',
        json.dumps(as_json).encode(),
        "text",
        b"{\xff",
        encode_request(*slice_examples(dense, values, lengths, 5, 9)),
    ]
    context = _Context()
    out = handler.handle([{"body": b} for b in bodies], context)
    assert len(out) == len(bodies)
    np.testing.assert_allclose(decode_response(out[1]), expected[0:2], atol=1e-6, rtol=0)
    np.testing.assert_allclose(decode_response(out[6]), expected[5:9], atol=1e-6, rtol=0)
    alone = handler.scoring.forward(
        to_tensors(*decode_json(as_json, names, handler.scoring.sparse_names))
    )
    np.testing.assert_allclose(out[3], alone.numpy(), atol=1e-6, rtol=0)
    reasons = {
        0: "body starts with '{' but is not JSON",
        2: "instances[0]: TypeError",
        4: "expected an RSB1 or JSON body, got str",
        5: "body starts with '{' but is not JSON",
    }
    assert set(context.status) == set(reasons)
    for i, reason in reasons.items():
        assert out[i].startswith(REJECTION + reason.encode()), out[i]
        assert context.status[i][0] == 400 and context.status[i][1].startswith(reason)


@pytest.mark.slow
def test_a_request_the_model_raises_on_fails_alone(exported: tuple[Path, Path, str]) -> None:
    export, _, _ = exported

    class Refuses(ScoringModel):
        """The real model, refusing any batch with a NaN dense value (a fault injected)."""

        def forward(self, batch: Tensors, model: object = None) -> torch.Tensor:
            if batch[0].isnan().any():
                raise RuntimeError("injected: NaN")
            return super().forward(batch, model)

    handler = _handler(Refuses(export, "mapped_int8.pt", torch.device("cpu")))
    dense, values, lengths, expected = _sample(export)
    cuts = [(0, 2), (2, 5), (5, 9)]
    bodies = [encode_request(*slice_examples(dense, values, lengths, a, b)) for a, b in cuts]
    poisoned = [t.clone() for t in slice_examples(dense, values, lengths, 2, 5)]
    poisoned[0][1, 3] = float("nan")  # the middle request's rows (a copy: the sample stays)
    bodies[1] = encode_request(*poisoned)
    context = _Context()
    out = handler.handle([{"data": b} for b in bodies], context)
    assert out[1] == REJECTION + b"RuntimeError: injected: NaN"
    assert context.status == {1: (500, "RuntimeError: injected: NaN")}
    for k in (0, 2):
        a, b = cuts[k]
        np.testing.assert_allclose(decode_response(out[k]), expected[a:b], atol=1e-6, rtol=0)
