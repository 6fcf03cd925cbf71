"""Shared helpers: run the real entry points (torchrun process groups) as subprocesses."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from recsys_stack.net import PORT_RANGE_ENV
from tests import warm

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Under pytest-xdist (make test), each worker and what it starts take free ports from a range
# of their own, below the kernel's ephemeral range (recsys_stack/net.py): one worker's stack
# can never take a port another has chosen but not bound yet.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    _first = 20_000 + 1_500 * int(_WORKER[2:])
    os.environ.setdefault(PORT_RANGE_ENV, f"{_first}-{_first + 1_499}")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


# What third-party noise looks like on a terminal: Python warnings (``file:line: XWarning:``
# and the ``warnings.warn(`` source line under them), torch's glog-style ``W1201 14:31:40`` lines,
# fbgemm's library loading, and any logging record from a library's logger.
_NOISE = re.compile(
    r"\w+Warning: |^\s*warnings\.warn\(|^[WE]\d{4} \d\d:\d\d|Successfully loaded|"
    r" (WARNING|INFO) (torch|torchrec|fbgemm_gpu|onnx_ir|onnxscript)[.:]"
)


def third_party_noise(output: str) -> list[str]:
    """The lines of a command's output that are third-party warnings (see recsys_stack/logs.py
    for what is silenced and why)."""
    return [line for line in output.splitlines() if _NOISE.search(line)]


def run_train(
    args: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
    cold: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=nproc -m training.train args`` (plain python for nproc=0);
    the run (or each rank) a child of the warm Python, ``tests/warm.py``, unless ``cold``."""
    if nproc == 0:
        proc = warm.run_module("training.train", args, ROOT, _env(env), timeout, cold=cold)
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
               "-m", "training.train", *args]  # fmt: skip
        run_env = warm.cold_env(_env(env)) if cold else _env(env)  # ranks: warm unless cold
        proc = subprocess.run(
            cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} exited {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}"
        )
    return proc


def make_command(target: str, variables: dict[str, str], args: Sequence[str] = ()) -> list[str]:
    """``make TARGET VAR=value ... ARGS='<args>'`` as a user types it (each of ``args`` shell-
    quoted, as the recipe's shell reads ARGS), with this venv taken as built: a test never
    reinstalls it (``-o``), even when a requirements file is newer."""
    venv = VENV_BIN.parent
    return [
        "make", "--no-print-directory", "-o", f"{venv}/.installed", target, f"VENV={venv}",
        *(f"{k}={v}" for k, v in variables.items()), f"ARGS={shlex.join(args)}",
    ]  # fmt: skip


def run_make(
    target: str, variables: dict[str, str], args: Sequence[str] = (), timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """:func:`make_command` run to its end; AssertionError with its output's tail if it fails."""
    cmd = make_command(target, variables, args)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{shlex.join(cmd)} exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this session sees: the session's temp root under
    pytest-xdist (each worker's own basetemp is a folder in it), else the basetemp itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides that put synthetic data and binary caches in one session-wide temp folder,
    shared by all pytest-xdist workers (concurrent runs wait for the first one to build a
    dataset, then reuse it: training/data/prep.py's locks)."""
    base = _shared_root(tmp_path_factory) / "data"
    return [f'data.cache_dir="{base / "cache"}"', f'data.synthetic_dir="{base / "synthetic"}"']


# A tiny model trained on 2 ranks (C1 column-wise) and exported: shared by export and serving tests.
EXPORT_TINY = ["--config", "training/configs/tiny.toml", "--no-progress"]
SHARDED = [
    'sharding.tables.t_C1.sharding_types=["column_wise"]',
    "sharding.tables.t_C1.min_partition=4",
    'sharding.tables.t_C2.sharding_types=["table_wise"]',
    "train.max_steps=40",
]


def run_export(
    args: list[str], check: bool = True, cold: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m training.export args``: a child of the warm Python (``tests/warm.py``), or
    a process of its own (``cold``: what a cold start prints, its import-time noise, is
    checked)."""
    proc = warm.run_module(
        "training.export", ["--no-progress", *args], ROOT, _env(), 300, cold=cold
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"export exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], str]
) -> tuple[Path, str]:
    """``build(folder)`` run once per test session, whatever the number of pytest-xdist
    workers: the first worker to ask builds it under a file lock, the others wait and read
    the result. (folder, the text ``build`` returned). A build that failed fails every asker
    with its message (tests must not take half a build for a whole one)."""
    from filelock import FileLock

    folder = _shared_root(tmp_path_factory) / f"shared-{name}"
    done, failed = folder.with_suffix(".done"), folder.with_suffix(".failed")
    with FileLock(str(folder.with_suffix(".lock"))):
        if not done.exists() and not failed.exists():
            folder.mkdir()
            try:
                done.write_text(build(folder))
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}")
                raise
    if failed.exists():
        raise AssertionError(
            f"the shared build {name!r} failed in another worker:\n{failed.read_text()[-4000:]}"
        )
    return folder, done.read_text()


def _train_and_export(folder: Path, data: list[str]) -> str:
    """The tiny model trained on 2 ranks (C1 column-wise), then exported as version 1.0 into
    its own model store, both cold (no warm Python): ``folder/run``, ``folder/store``; the export's stdout. Built as one
    step so that no test copies the run while its export is being written."""
    run, store = folder / "run", folder / "store"
    # cold, as the export below: every run of the suite (CI's included) starts torchrun's
    # ranks and the export as a user's shell does, so what the warm Python hides shows here
    run_train([*EXPORT_TINY, "--run-dir", str(run), *data, *SHARDED], nproc=2, cold=True)
    proc = run_export(
        ["--run-dir", str(run), "--model-store", str(store), "--version", "1.0"], cold=True
    )
    assert not third_party_noise(proc.stdout + proc.stderr), third_party_noise(proc.stderr)[:10]
    return proc.stdout


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory, data_dirs: list[str]) -> tuple[Path, str]:
    """:func:`_train_and_export`, once per session (shared by all workers)."""
    return built_once(tmp_path_factory, "tiny", lambda d: _train_and_export(d, data_dirs))


@pytest.fixture(scope="session")
def trained(tiny_export: tuple[Path, str]) -> Path:
    """The tiny trained run (read only: tests copy it to change it)."""
    return tiny_export[0] / "run"


@pytest.fixture(scope="session")
def exported(tiny_export: tuple[Path, str]) -> tuple[Path, Path, str]:
    """(the tiny run's export folder, its model store holding dlrm-tiny-1.0.mar, the export's
    stdout)."""
    folder, stdout = tiny_export
    return folder / "run" / "export", folder / "store", stdout


# The formats the portable tests ask for besides the default's: without fp16, so the portable
# TorchScript pair is what CUDA workers load and the .mar carries it beside the int8 tables.
PORTABLE_FORMATS = '["int8", "fp32", "portable", "pt2", "onnx"]'


@pytest.fixture(scope="session")
def exported_portable(
    trained: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str]:
    """Like ``exported``, of a copy of the run, with the portable formats asked for
    (``--formats``): TorchScript fp32/fp16 + ``portable_state.pt``, the pt2 program, ONNX."""

    def build(base: Path) -> str:
        run = base / "run"  # a copy: exporting writes <run>/export, which ``exported`` reads
        shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export", ".export*"))
        proc = run_export(
            ["--run-dir", str(run), "--model-store", str(base / "store"), "--version", "1.0",
             "--formats", PORTABLE_FORMATS, "--latency"], cold=True,
        )  # fmt: skip
        noise = third_party_noise(proc.stdout + proc.stderr)
        assert not noise, noise[:10]
        return proc.stdout

    base, stdout = built_once(tmp_path_factory, "portable", build)
    return base / "run" / "export", base / "store", stdout


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """The root logger's handlers and level as they were before the test. Entry points run
    in-process (``main(argv)``) configure logging on the stderr of their moment, which is
    pytest's capture of that test; a later test's ``logging.basicConfig`` then keeps that
    closed stream and every record becomes a "--- Logging error ---" traceback."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


# The modules that take longest (seconds in a parallel run's junit report, heaviest first). Under
# pytest-xdist (make test) each module runs whole in one worker (--dist loadfile: its module
# fixtures, a TorchServe or a trained run, are built once, not once per worker that got one of
# its tests), and the longest go first so that none starts last and runs alone at the end
# (longest-processing-time-first), except that the third is one that needs no session build:
# the second builds the tiny run its fixtures ask for, and a third waiting on it idles a
# worker for that minute. Only the order depends on this list: a module missing from it runs
# after these, in collection order.
LONGEST_FIRST = (
    "training/test_continuous.py", "serving/test_rollout.py", "training/test_train.py",
    "loadtest/test_loadtest.py", "serving/test_takeover.py", "training/test_portable.py",
    "loadtest/test_chaos.py", "streaming/test_joiner.py", "training/test_continuous_deltas.py",
    "training/test_continuous_poison.py", "serving/test_isolation.py",
    "training/test_bench_scale.py", "serving/test_auth.py", "serving/test_supervisor.py",
    "serving/test_canary.py", "serving/test_tenants.py", "serving/test_gateway.py",
    "training/test_frozen_recipe.py", "serving/test_bench.py", "training/test_multinode.py",
    "serving/test_wire.py", "serving/test_limits.py", "training/test_delta.py",
    "serving/test_mapped.py", "serving/test_overload.py", "serving/test_failover.py",
    "serving/test_defaults.py", "serving/test_lite.py", "serving/test_channel.py",
    "serving/test_connections.py", "training/test_preprocess.py", "serving/test_scale.py",
    "training/test_sweep.py", "serving/test_logs.py", "test_notebook.py",
    "serving/test_feature_log.py", "serving/test_portable.py", "serving/test_admission.py",
    "serving/test_rest_bodies.py", "test_readme.py", "training/test_errors.py",
    "training/test_baseline_tuned.py", "serving/test_threads.py", "test_structure.py",
    "serving/test_tls_tools.py", "serving/test_metrics.py", "training/test_export.py",
    "serving/test_kserve_rest.py", "serving/test_kserve.py", "training/test_bench.py",
    "deploy/test_train_job.py", "test_warm.py", "training/test_presets_guard.py",
    "serving/test_evaluate.py", "training/test_interrupt.py", "serving/test_coalesce.py",
    "serving/test_discovery.py", "serving/test_torchserve.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of :data:`LONGEST_FIRST` first, in its order; the rest keep theirs (a stable
    sort: the tests of a module keep their order)."""
    rank = {f"tests/{m}": i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# the file that marks a temp root as this suite's: only marked roots are ever removed
SUITE_MARK = ".recsys-suite-root"


def remove_old_roots(tmp: Path, age_s: float = 86400) -> list[Path]:
    """Remove this suite's temp roots under ``tmp`` older than ``age_s``: ``rs-*`` folders
    holding :data:`SUITE_MARK` and owned by this user (another user's or another tool's
    ``rs-*`` on a shared machine is left alone). The removed ones."""
    import time

    removed = []
    for old in tmp.glob("rs-*"):
        with contextlib.suppress(OSError):
            st = old.stat()
            if (
                (old / SUITE_MARK).is_file()
                and st.st_uid == os.getuid()
                and time.time() - st.st_mtime > age_s
            ):
                shutil.rmtree(old, ignore_errors=True)
                removed.append(old)
    return removed


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A short temp root when the suite runs in xdist workers and none was given: each worker's
    folder (``popen-gwN``) adds a level under ``/tmp/pytest-of-<user>/pytest-<n>``, and the
    TorchServe workdirs under it must stay short enough for its AF_UNIX sockets
    (serving/torchserve/process.py refuses deeper ones). Kept after the run for its logs, as
    pytest keeps its own; this suite's roots (marked with :data:`SUITE_MARK`, owned by this
    user) of runs older than a day are removed (no live run is); nothing else in /tmp is."""
    import tempfile

    workers = getattr(config.option, "numprocesses", None)
    if workers and config.option.basetemp is None and not os.environ.get("PYTEST_XDIST_WORKER"):
        tmp = Path(tempfile.gettempdir())
        remove_old_roots(tmp)
        root = Path(tempfile.mkdtemp(prefix="rs-", dir=tmp))
        (root / SUITE_MARK).write_text("recsys test suite root\n")
        config.option.basetemp = str(root / "t")  # pytest empties basetemp: the mark sits above
    if not workers or hasattr(config, "workerinput"):  # a process that runs tests, not xdist's
        warm.install(ROOT, _env())  # controller: its entry-point starts go to a warm Python


# The suite starts ~35 short-lived TorchServes: C1-only JIT and a serial GC for their Java
# frontends (serving/torchserve/config.py ``jvm_args``: a third less CPU to READY and over
# their first calls, measured there). A variable set before the run wins.
os.environ.setdefault("RECSYS_TS_JVM_ARGS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
