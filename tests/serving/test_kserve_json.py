"""KServe v2 JSON bodies in process (serving/gateway/kserve_json.py): bombs refused with bounded
work (tracemalloc's peak: what a parse or numpy allocated), one-line errors naming the input,
and the decode queue; the real gateway's answers are in test_rest_bodies.py."""

from __future__ import annotations

import asyncio
import json
import threading
import tracemalloc
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from serving.gateway import kserve_json as kj
from serving.gateway.errors import ScoreError
from serving.gateway.kserve import SPECS
from serving.gateway.validate import InvalidRequest, Limits, Schema

MIB = 1 << 20
SCHEMA = Schema("m", "1", tuple(f"I{i}" for i in range(13)), tuple(f"C{i}" for i in range(26)))
# what kserve_json.decoded() needs of a kserve.Model: its schema, limits and arrays()
MODEL: Any = SimpleNamespace(
    schema=SCHEMA,
    ranker=SimpleNamespace(cfg=SimpleNamespace(limits=Limits())),
    arrays=lambda decode, outputs, size: decode(),
)


def _peak(work: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``work()`` raised (None: nothing) and the most memory it held at once."""
    tracemalloc.start()
    try:
        work()
        raised = None
    except BaseException as e:  # returned to the test
        raised = e
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return raised, peak


def _decode(body: bytes, header_length: str | None = None) -> Any:
    """``body`` through :func:`kj.decoded`, as the REST route decodes it (the tensors)."""
    return kj.decoded(MODEL, body, header_length)[0]


def _request(name: str, shape: list[int], data: Any) -> dict[str, Any]:
    """A request whose input ``name`` holds ``data``; it is decoded first (the others are
    missing)."""
    kinds = {"dense": "FP32", "values": "INT64", "lengths": "INT32"}
    return {"inputs": [{"name": name, "datatype": kinds[name], "shape": shape, "data": data}]}


def test_an_object_bomb_stops_at_the_bound() -> None:
    """4 MiB of ``[{},{},...]``: the parse stops at the object past :data:`MAX_OBJECTS`
    (json.loads held ~100 MB for it, and the GIL for ~0.1 s)."""
    body = b"[" + b"{}," * (4 * MIB // 3) + b"{}]"
    raised, peak = _peak(lambda: _decode(body))
    assert isinstance(raised, InvalidRequest), raised
    assert "over 28 JSON objects" in str(raised)
    assert peak < 3 * len(body), (
        f"{peak / MIB:.0f} MiB held parsing a {len(body) / MIB:.0f} MiB bomb"
    )


def test_a_list_bomb_is_refused_before_parsing() -> None:
    """``[[],[],...]`` (0.45 s to parse 4 MiB) and ``[[[[...``: counted, not parsed."""
    for body in (b"[" + b"[]," * (4 * MIB // 3) + b"[]]", b"[" * 100_000):
        raised, peak = _peak(lambda b=body: _decode(b))  # type: ignore[misc]
        assert isinstance(raised, InvalidRequest), raised
        assert "at most 1050" in str(raised) and peak < MIB  # 1,000 examples + 26 features + 24


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 100_000])
def test_nesting_past_the_parser_is_invalid_not_a_recursion_error(body: bytes) -> None:
    with pytest.raises(InvalidRequest, match="nests too deep"):
        kj.Infer(body, None)  # no bound on '[': the parser's own depth stops it


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_while_parsing(constant: str) -> None:
    body = b'{"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1], "data": [%s]}]}'
    with pytest.raises(InvalidRequest, match=f"holds {constant}:"):
        _decode(body % constant.encode())


@pytest.mark.parametrize(
    "header", ["9" * 5000, "\u00b2", "٣", "-1", "1e3", "0x10", "12 34", "", "99999999999999"]
)
def test_a_header_length_that_is_no_length_within_the_body_is_invalid(header: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^{kj.HEADER_LENGTH}: ") as e:
        _decode(b"{}" * 10, header)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize(
    ("name", "shape", "data", "message"),
    [
        ("values", [2], ["a", "b"], "input 'values': data holds str values"),
        ("values", [2], [1, None], "input 'values': data holds null"),
        ("values", [2], [1, {}], "input 'values': data holds objects"),
        ("values", [2], [1, [2]], "input 'values': data holds numbers and lists mixed"),
        ("values", [2], [[1], 2], "input 'values': data holds rows and numbers mixed"),
        ("dense", [1, 13], [[[0.5] * 13]], "input 'dense': data holds lists nested deeper"),
        ("values", [2], [1.5, 2], "input 'values': data holds float values; the model takes"),
        ("lengths", [1, 1], [[2**31]], "input 'lengths': data out of the range of INT32"),
        ("values", [1], [2**64], "input 'values': data out of the range of INT64"),
        ("dense", [2, 1], [[0.5], [0.5, 0.5]], "input 'dense': data is not a list of numbers"),
    ],
)
def test_data_that_is_not_numbers_is_named_by_its_input(
    name: str, shape: list[int], data: Any, message: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        _decode(json.dumps(_request(name, shape, data)).encode())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_strings_never_reach_numpy() -> None:
    """``np.asarray`` made ``["x" * 1000, "", "", ...]`` (300 KB of JSON) a 400 MB array of
    strings before its dtype was looked at; the check before it allocates nothing."""
    data = ["x" * 1000] + [""] * 100_000
    raised, peak = _peak(lambda: kj.JSON.array(data, SPECS["values"]))
    assert isinstance(raised, InvalidRequest) and "data holds str" in str(raised)
    assert peak < MIB, f"{peak / MIB:.0f} MiB held refusing strings"


def test_numbers_decode_as_before() -> None:
    """Flat and nested data, ints where floats go, true/false as 1/0 (Python's view of JSON)."""
    dense, values, lengths = _decode(json.dumps({"inputs": [
        {"name": "dense", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2.5], [3, 4]]},
        {"name": "values", "datatype": "INT64", "shape": [3], "data": [7, 2**62, True]},
        {"name": "lengths", "datatype": "INT32", "shape": [1, 2], "data": [2, 1]},
    ]}).encode())  # fmt: skip
    assert dense.dtype.name == "float32" and dense.tolist() == [[1.0, 2.5], [3.0, 4.0]]
    assert values.dtype.name == "int64" and values.tolist() == [7, 2**62, 1]
    assert lengths.dtype.name == "int32" and lengths.tolist() == [[2, 1]]


def test_a_valid_request_is_within_every_bound() -> None:
    """The largest valid request (every input nested by its shape, parameters everywhere)
    passes the bounds on '[' and objects."""
    b, d, f = 1000, 13, 26
    params = {"parameters": {"binary_data": False}}
    doc = {"id": "x", "parameters": {"binary_data_output": False, "timeout": 5},
           "outputs": [{"name": "scores", **params}],
           "inputs": [{"name": "dense", "datatype": "FP32", "shape": [b, d], **params,
                       "data": [[0.5] * d] * b},
                      {"name": "values", "datatype": "INT64", "shape": [f * b], **params,
                       "data": [1] * (f * b)},
                      {"name": "lengths", "datatype": "INT32", "shape": [f, b], **params,
                       "data": [[1] * b] * f}]}  # fmt: skip
    assert _decode(json.dumps(doc).encode())[0].shape == (b, d)


def test_decodes_run_one_at_a_time_and_refuse_past_the_queue() -> None:
    """One parse at a time off the loop; waiting bodies up to ``queued`` bytes; past that,
    RESOURCE_EXHAUSTED at once; a waiter cancelled leaves the queue."""

    async def scenario() -> None:
        decodes, release, order = kj.Decodes(), threading.Event(), []

        def slow() -> str:
            release.wait(10)
            order.append("slow")
            return "slow"

        def quick(name: str) -> Callable[[], str]:
            return lambda: order.append(name) or name  # type: ignore[func-returns-value]

        first = asyncio.create_task(decodes.run(slow, 100, queued=250))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(decodes.run(quick("second"), 100, queued=250))
        gone = asyncio.create_task(decodes.run(quick("gone"), 100, queued=250))
        await asyncio.sleep(0.05)
        assert decodes.waiting == 200
        with pytest.raises(ScoreError) as e:
            await decodes.run(quick("refused"), 100, queued=250)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in e.value.message and "\n" not in e.value.message
        gone.cancel()
        await asyncio.sleep(0.01)
        assert decodes.waiting == 100
        release.set()
        assert await first == "slow" and await second == "second"
        assert order == ["slow", "second"] and decodes.waiting == 0
        assert await decodes.run(quick("alone"), 10**9, queued=0) == "alone"  # none waits

    asyncio.run(scenario())
