"""Tables mapped from disk (``recsys_model.mapped``): same scores, one copy shared by the
processes that map them (PSS, not RSS), a clear error for a bad file, and a process confined to
half the table bytes still scoring a power-law load (a real cgroup memory limit).

The TorchServe end of it (two workers of one replica, registration of a corrupt archive) is in
tests/serving/test_scale.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from recsys_model.mapped import drop_cached, load_mapped, pack, save_dense, unpack
from recsys_model.portable_model import PortableScorer
from recsys_model.table_writer import write_tables
from tests.conftest import ROOT, _env

F = 26


def scorer(rows: list[int], dim: int = 16, seed: int = 0) -> PortableScorer:
    spec = {"rows": rows, "dim": dim, "dense_arch": [32, dim], "over_arch": [32, 1],
            "num_dense": 13, "arch": "dlrm"}  # fmt: skip
    torch.manual_seed(seed)
    m = PortableScorer(spec).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def save(m: PortableScorer, out: Path, fmt: str, chunk: int = 4096) -> Path:
    total = int(m.weight.shape[0])
    rec = write_tables(
        out / f"tables_{fmt}.bin", total, m.dim, fmt,
        ((s, m.weight[s : s + chunk].detach()) for s in range(0, total, chunk)),
    )  # fmt: skip
    save_dense(out / f"mapped_{fmt}.pt", m, rec)
    return out / f"mapped_{fmt}.pt"


def batch(b: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (F, b), dtype=torch.int32, generator=g)
    values = torch.randint(0, 1 << 40, (int(lengths.sum()),), generator=g)
    return torch.rand(b, 13, generator=g) * 10, values, lengths


@pytest.mark.parametrize(
    ("fmt", "atol"), [("fp32", 0.0), ("fp16", 5e-4), ("int8", 5e-3), ("int4", 2e-2)]
)
def test_mapped_scores_like_the_portable_scorer(tmp_path: Path, fmt: str, atol: float) -> None:
    m = scorer([1000, 50, 20_000] + [100] * (F - 3))
    x = batch()
    got = load_mapped(save(m, tmp_path, fmt), torch.device("cpu"))(*x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, m(*x), atol=atol, rtol=0)


@pytest.mark.parametrize(("fmt", "width"), [("int8", 16 + 8), ("int4", 16 // 2 + 4)])
def test_the_tables_are_not_copied(tmp_path: Path, fmt: str, width: int) -> None:
    m = scorer([5000] * F)
    path = save(m, tmp_path, fmt)
    loaded = load_mapped(path, torch.device("cpu"))
    assert loaded.weight.numel() == 0  # the MLPs are the only weights in memory
    ((got, grid, _, _),) = loaded.sections
    assert (got, grid.shape) == (fmt, (5000 * F, width))
    assert (tmp_path / f"tables_{fmt}.bin").stat().st_size == 5000 * F * width
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith(f"tables_{fmt}.bin")]  # fmt: skip
    assert mapped, "the kernel reads the file's mapping, not a copy of it"


def test_a_mixed_file_scores_each_table_in_its_own_format(tmp_path: Path) -> None:
    m = scorer([1000, 50, 20_000] + [100] * (F - 3))
    rows = [int(r) for r in m.spec["rows"]]
    formats = (["int4", "int8", "fp16"] * F)[:F]
    rec = write_tables(
        tmp_path / "tables_mixed.bin", sum(rows), m.dim, "mixed",
        ((s, m.weight[s : s + 777].detach()) for s in range(0, sum(rows), 777)),  # across tables
        list(zip(rows, formats, strict=True)),
    )  # fmt: skip
    save_dense(tmp_path / "mapped_mixed.pt", m, rec)
    x = batch()
    expect = m(*x)
    for t, fmt in enumerate(formats):  # the same tables, each lowered alone by its own format
        lo = sum(rows[:t])
        m.weight.data[lo : lo + rows[t]] = unpack(pack(m.weight[lo : lo + rows[t]], fmt), fmt)
    loaded = load_mapped(tmp_path / "mapped_mixed.pt", torch.device("cpu"))
    assert [s[0] for s in loaded.sections] == ["fp16", "int8", "int4"]
    torch.testing.assert_close(loaded(*x), m(*x), atol=1e-5, rtol=0)
    assert (loaded(*x) - expect).abs().max() > 0  # the int4 tables do change scores
    with pytest.raises(ValueError, match=r"tables_mixed\.bin: tables .* do not make"):
        write_tables(tmp_path / "tables_mixed.bin", sum(rows), m.dim, "mixed", [])
    with pytest.raises(ValueError, match="int4 tables need an even embedding dim"):
        pack(torch.zeros(2, 15), "int4")


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "missing", "not_a_model"])
def test_a_bad_file_is_one_error_naming_it(tmp_path: Path, damage: str) -> None:
    path = save(scorer([300] * F), tmp_path, "int8")
    tables = tmp_path / "tables_int8.bin"
    if damage == "truncated":
        os.truncate(tables, tables.stat().st_size - 100)
        match = "tables_int8.bin: .* bytes, but the export wrote"
    elif damage == "corrupt":
        with tables.open("r+b") as f:
            f.seek(1000)
            f.write(b"\xff" * 16)
        match = "tables_int8.bin: checksum differs"
    elif damage == "missing":
        tables.unlink()
        match = "tables_int8.bin: -1 bytes"
    else:
        path.write_bytes(b"garbage")
        match = "mapped_int8.pt: not a mapped model file"
    with pytest.raises(ValueError, match=match):
        load_mapped(path, torch.device("cpu"))


# A child that maps the tables, reads every row (every page resident), scores a batch, and
# reports its memory; run twice at once, the two share one copy.
CHILD = textwrap.dedent("""
    import json, sys, time, torch
    from pathlib import Path
    from recsys_model.mapped import load_mapped
    from tests.serving.test_mapped import batch
    m = load_mapped(Path(sys.argv[1]), torch.device("cpu"))
    assert torch.isfinite(m.weight.sum()) and m(*batch()).shape == (64,)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent reads /proc while both are alive
    rollup = Path("/proc/self/smaps_rollup").read_text().split()
    pick = lambda k: int(rollup[rollup.index(k) + 1]) * 1024
    print(json.dumps({"rss": pick("Rss:"), "pss": pick("Pss:")}), flush=True)
""")


def test_two_processes_share_one_copy(tmp_path: Path) -> None:
    """Each child's RSS counts the whole table file; their PSS shares it: the sum of PSS is
    about one copy plus each one's own memory, where copies would be two."""
    m = scorer([200_000] * F)  # 5.2M rows x 16 fp32: 333 MB of tables
    path = save(m, tmp_path, "fp32", chunk=1 << 20)
    table_bytes = (tmp_path / "tables_fp32.bin").stat().st_size
    del m
    kids = [child(CHILD, str(path)) for _ in range(2)]
    try:
        for k in kids:
            assert k.stdout is not None and k.stdout.readline().strip() == "ready"
        stats = []
        for k in kids:
            assert k.stdin is not None and k.stdout is not None
            k.stdin.write("\n")
            k.stdin.flush()
            stats.append(json.loads(k.stdout.readline()))
    finally:
        for k in kids:
            k.kill()
            k.wait()
    own = [s["rss"] - table_bytes for s in stats]  # what each holds besides the tables
    assert max(own) < table_bytes  # the test measures the tables, not the process
    print(f"tables {table_bytes / 2**20:.0f} MiB; RSS {[s['rss'] >> 20 for s in stats]} MiB; "
          f"PSS {[s['pss'] >> 20 for s in stats]} MiB")  # fmt: skip
    assert all(s["rss"] > table_bytes for s in stats)  # each one maps all of it...
    assert sum(s["pss"] for s in stats) < table_bytes * 1.1 + sum(own)  # ...once between them


def child(code: str, *args: str) -> subprocess.Popen[str]:
    """``python -c code args`` from the repository root, talking over pipes."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def memory_cgroup() -> Path | None:
    """A writable cgroup v1 memory hierarchy (root here and on CI), else None."""
    base = Path("/sys/fs/cgroup/memory")
    return base if os.access(base, os.W_OK) else None


ZIPF = textwrap.dedent("""
    import json, resource, sys, time, numpy as np, torch
    from pathlib import Path
    from recsys_model.mapped import load_mapped
    Path(sys.argv[2]).write_text(str(__import__("os").getpid()))  # the parent confines us
    sys.stdin.readline()
    m = load_mapped(Path(sys.argv[1]), torch.device("cpu"))
    assert torch.isfinite(m.weight.sum())  # every row read once: more than the limit holds
    rows = m.rows.tolist()
    rng = np.random.default_rng(0)
    t0, b = time.perf_counter(), 100
    for _ in range(200):
        ids = np.concatenate([rng.zipf(1.15, b) % r for r in rows]).astype(np.int64)
        m(torch.zeros(b, 13), torch.from_numpy(ids), torch.ones((len(rows), b), dtype=torch.int32))
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"s": time.perf_counter() - t0, "major_faults": use.ru_majflt}))
""")


def test_a_process_confined_to_half_the_tables_still_scores(tmp_path: Path) -> None:
    """The issue's host smaller than its tables: a cgroup memory limit of half the table file
    (above the process's own needs), a power-law load, no OOM kill, the cold rows paged in."""
    cgroups = memory_cgroup()
    if cgroups is None:
        pytest.skip("no writable cgroup v1 memory hierarchy (needs root)")
    m = scorer([400_000] * F)  # 10.4M rows x 16 fp32: 666 MB of tables
    path = save(m, tmp_path, "fp32", chunk=1 << 20)
    table_bytes = (tmp_path / "tables_fp32.bin").stat().st_size
    del m
    drop_cached(tmp_path / "tables_fp32.bin")  # else its pages stay charged to this process
    group = cgroups / f"recsys-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    pid_file = tmp_path / "pid"
    kid = child(ZIPF, str(path), str(pid_file))
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert kid.poll() is None
        base = int(Path(f"/proc/{kid.pid}/status").read_text().split("VmRSS:")[1].split()[0])
        limit = base * 1024 + 64 * 2**20 + table_bytes // 2  # its own memory, + half the tables
        (group / "memory.limit_in_bytes").write_text(str(limit))
        (group / "cgroup.procs").write_text(str(kid.pid))
        out, _ = kid.communicate("\n", timeout=600)
        assert kid.returncode == 0, f"exit {kid.returncode} (-9: killed for memory)"
        report = json.loads(out.strip().splitlines()[-1])
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        print(f"limit {limit >> 20} MiB for {table_bytes >> 20} MiB of tables: peak {peak >> 20}"
              f" MiB, {report}")  # fmt: skip
        assert peak <= limit
        assert peak > table_bytes // 2  # the limit was reached: rows were evicted, paged in
    finally:
        kid.kill()
        kid.wait()
        group.rmdir()


def test_a_replaced_file_keeps_serving_the_mapped_version(tmp_path: Path) -> None:
    """Exports replace files by rename (a new inode): a worker that mapped the old tables keeps
    scoring with them, whole, until it loads the new version; no torn read."""
    old, new = scorer([3000] * F, seed=0), scorer([3000] * F, seed=1)
    x = batch()
    path = save(old, tmp_path, "int8")
    served = load_mapped(path, torch.device("cpu"))
    before = served(*x)
    staging = tmp_path / "next"
    staging.mkdir()
    save(new, staging, "int8")
    for name in ("tables_int8.bin", "mapped_int8.pt"):  # what the export's swap does
        os.replace(staging / name, tmp_path / name)
    torch.testing.assert_close(served(*x), before, atol=0, rtol=0)
    reloaded = load_mapped(path, torch.device("cpu"))
    torch.testing.assert_close(reloaded(*x), new(*x), atol=5e-3, rtol=0)
    assert not torch.equal(reloaded(*x), before)


def _overwrite_in_place(tables: Path, keep_mtime: bool = True) -> None:
    """Other bytes in the same file (same inode, same size), its mtime put back as ``cp -p`` or
    ``rsync -t`` would: only the ctime, which no user call can set, tells that it changed."""
    st = tables.stat()
    time.sleep(0.05)  # past the filesystem's timestamp tick, so the ctime moves
    with tables.open("r+b") as f:
        f.seek(1000)
        flipped = bytes(b ^ 0xFF for b in f.read(16))
        f.seek(1000)
        f.write(flipped)
    if keep_mtime:
        os.utime(tables, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = tables.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_an_overwrite_in_place_with_the_mtime_kept_is_verified_again(tmp_path: Path) -> None:
    """The first load hashes the tables and leaves a marker; a later load skips the hash only
    for the very file it hashed (inode, size, mtime, ctime), so an in-place overwrite of the
    same size is hashed again and refused."""
    path = save(scorer([300] * F), tmp_path, "int8")
    load_mapped(path, torch.device("cpu"))
    assert [p.name for p in tmp_path.glob(".verified-*")]  # the marker the next load reads
    load_mapped(path, torch.device("cpu"))  # the same file: no hash, still loads
    _overwrite_in_place(tmp_path / "tables_int8.bin")
    with pytest.raises(ValueError, match=r"tables_int8\.bin: checksum differs"):
        load_mapped(path, torch.device("cpu"))


# A child that maps the tables, scores, then has its table file changed under the mapping
# (argv[2]: "overwrite" in place, or "truncate"); the next batch must be one clear error, not
# wrong scores nor a SIGBUS that kills the worker.
CHANGED = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from recsys_model.mapped import load_mapped
    from tests.serving.test_mapped import batch
    path = Path(sys.argv[1])
    m = load_mapped(path, torch.device("cpu"))
    assert m(*batch()).shape == (64,)
    tables = path.parent / "tables_int8.bin"
    if sys.argv[2] == "truncate":
        os.truncate(tables, 0)
    else:
        with tables.open("r+b") as f:
            f.seek(0)
            f.write(b"\\x5a" * 4096)
    try:
        m(*batch())
    except RuntimeError as e:
        print("refused:", e, flush=True)
        sys.exit(0)
    print("scored", flush=True)
    sys.exit(3)
""")


@pytest.mark.parametrize("change", ["overwrite", "truncate"])
def test_tables_changed_under_a_live_mapping_refuse_the_next_batch(
    tmp_path: Path, change: str
) -> None:
    path = save(scorer([3000] * F), tmp_path, "int8")
    proc = subprocess.run(
        [sys.executable, "-c", CHANGED, str(path), change],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("refused:")]
    assert "tables_int8.bin changed on disk under this worker" in line, line
