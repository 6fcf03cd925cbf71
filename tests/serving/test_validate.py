"""The gateway's request validation in process: arrays in schema order, errors that name the
feature and the example (the real gateway's codes are tested in test_gateway.py)."""

from __future__ import annotations

import numpy as np
import pytest

from serving.gateway.validate import InvalidRequest, Limits, Schema, validate
from serving.tools.client import build_request

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]
SCHEMA = Schema(model_name="m", model_version="1", dense=tuple(DENSE), sparse=tuple(SPARSE))


def _request(b: int = 5, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(b, 13)).astype(np.float32)
    sparse = rng.integers(-1, 50, size=(b, 26))  # -1 = missing
    return build_request(dense, sparse), dense, sparse


def _reference(sparse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Feature-major ids and lengths, the slow obvious way."""
    lengths = (sparse.T >= 0).astype(np.int32)
    values = np.array([x for f in range(26) for x in sparse[:, f] if x >= 0], dtype=np.int64)
    return values, lengths


def test_arrays_are_in_schema_order_whatever_the_request_order() -> None:
    request, dense, sparse = _request()
    d, values, lengths = validate(request, SCHEMA, Limits())
    ref_values, ref_lengths = _reference(sparse)
    np.testing.assert_array_equal(d, dense)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(lengths, ref_lengths)
    shuffled = type(request)()
    shuffled.CopyFrom(request)
    del shuffled.sparse[:]
    shuffled.sparse.extend(reversed(request.sparse))
    _, values2, lengths2 = validate(shuffled, SCHEMA, Limits())
    np.testing.assert_array_equal(values2, ref_values)
    np.testing.assert_array_equal(lengths2, ref_lengths)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.sparse[3].ids.__setitem__(-1, -7), "sparse[C4] of example"),
        (
            lambda r: r.sparse[5].lengths.__setitem__(2, -1),
            "sparse[C6].lengths of example 2 is negative",
        ),
        (lambda r: r.sparse[7].lengths.__setitem__(1, 99), "sparse[C8] of example 1 has 99 ids"),
        (lambda r: r.sparse[2].ids.append(3), "sparse[C3]: lengths add up to"),
        (lambda r: r.sparse[0].lengths.append(1), "sparse[C1].lengths: 6 entries for 5 examples"),
        (lambda r: setattr(r.sparse[9], "name", "C99"), "unknown feature 'C99'"),
        (lambda r: setattr(r.sparse[9], "name", "C1"), "feature 'C1' appears twice"),
    ],
)
def test_errors_name_the_feature_and_example(mutate, message) -> None:  # type: ignore[no-untyped-def]
    request, _, sparse = _request(seed=3)
    sparse_present = sparse >= 0
    assert sparse_present[:, 3].any()  # C4 has ids to corrupt
    mutate(request)
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(request, SCHEMA, Limits(max_ids_per_feature=64))


def test_a_negative_id_names_its_example() -> None:
    request, _, sparse = _request(b=6, seed=4)
    f = 10
    present = np.flatnonzero(sparse[:, f] >= 0)
    target = int(present[-1])  # the last example with an id in this feature
    request.sparse[f].ids[-1] = -5
    with pytest.raises(
        InvalidRequest, match=rf"sparse\[C11\] of example {target} has a negative id \(-5\)"
    ):
        validate(request, SCHEMA, Limits())
