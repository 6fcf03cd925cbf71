"""serving/gateway/_fastwire.c under AddressSanitizer and UBSan.

The wire tests compare the C walk with numpy's on fuzzed bytes, but a read past a buffer or of
freed memory usually returns plausible bytes and passes them. Here the same comparisons run
against a build with ``-fsanitize=address,undefined``, in a process that preloads the
sanitizers' runtimes: any such read aborts it with a report.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import ROOT, _env

SOURCE = ROOT / "serving" / "gateway" / "_fastwire.c"
FUZZ = """
import importlib.util, sys
import numpy as np
from serving.gateway import wire
from tests.serving.test_wire import _ours, _reference, _walk, client_request, random_request
spec = importlib.util.spec_from_file_location("serving.gateway._fastwire", sys.argv[1])
wire._fastwire = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wire._fastwire)
rng = np.random.default_rng(21)
for i in range(3000):
    data = bytearray(client_request(rng) if i % 2 else random_request(rng).SerializeToString())
    for _ in range(int(rng.integers(0, 3))):
        if data:
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
    if i % 5 == 4:
        data = data[: int(rng.integers(0, len(data) + 1))]
    data = bytes(data)
    assert _walk(data, True) == _walk(data, False), data[:60]
    ref, ours = _reference(data), _ours(data)
    assert isinstance(ref, str) == isinstance(ours, str), data[:60]
from serving.gateway.featurelog import format_impressions, heads
head, mid = heads("a.b.1.c", 1, "m", "v")
for i in range(300):  # the feature log's lines: the C formatter against its Python twin
    b = int(rng.integers(0, 40))
    dense = rng.integers(-9, 99, (b, 13)).astype(np.float32)
    dense[rng.random((b, 13)) < 0.01] = 0.5
    lengths = rng.integers(0, 3 if i % 3 else 2, (26, b)).astype(np.int32)
    values = rng.integers(0, 2**63 - 1, int(lengths.sum()), dtype=np.int64)
    args = (head, mid, dense, values, lengths, rng.random(b).astype(np.float32))
    assert wire._fastwire.impressions(*args) == format_impressions(*args)
    if values.size:
        try:
            wire._fastwire.impressions(head, mid, dense, values[:-1], lengths, args[-1])
            raise AssertionError("ids short of the lengths were read")
        except ValueError:
            pass
print("clean")
"""


def _runtime(name: str) -> str:
    path = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(path).is_file(), f"gcc has no {name} (install gcc's sanitizer runtimes)"
    return path


def test_the_native_code_reads_nothing_it_should_not(tmp_path: Path) -> None:
    built = tmp_path / "_fastwire_asan.so"
    subprocess.run(
        ["gcc", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", "-shared", "-fPIC",
         f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(built)],
        check=True, timeout=120,
    )  # fmt: skip
    env = _env({
        "LD_PRELOAD": f"{_runtime('libasan.so')}:{_runtime('libubsan.so')}",
        "ASAN_OPTIONS": "detect_leaks=0",  # CPython's own allocations are not ours to judge
    })  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ, str(built)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-3000:]
