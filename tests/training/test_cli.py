"""The training entry points' command lines: one config mechanism, documented, strict.

``python -m training.train``, ``python -m training.export`` and ``python -m training.bench``
take ``--config FILE.toml``, a flag per config field and ``section.key=value`` overrides; a
misspelled key is one ``error:`` line with a suggestion and exit code 2.
"""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest

from recsys_stack.config import flag_name, iter_keys
from tests.conftest import ROOT, run_train
from training.bench.run import main as bench_main
from training.config import Config, parse_args
from training.config import build_parser as train_parser
from training.export.__main__ import build_parser as export_parser
from training.export.__main__ import main as export_main
from training.export.__main__ import parse_args as export_args
from training.export.config import ExportConfig

TINY = "training/configs/tiny.toml"


def _only_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def _in_process(main: typing.Callable[..., int], argv: list[str], capsys: typing.Any) -> str:
    """``main(argv)`` here (the subprocess path is covered once, for training.train): its one
    error line; the entry point must exit 2 with nothing else on stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    return _only_error(subprocess.CompletedProcess([], int(code or 0), "", err))


def _documents_every_field(help_text: str, cls: type) -> None:
    """Each leaf field's flag and docstring (or, for a table of tables, its path) is listed."""
    flat = "".join(help_text.split())  # argparse wraps lines, also at hyphens
    for key in iter_keys(cls):
        assert key.doc, f"{cls.__name__}.{key.path} has no docstring"
        if typing.get_origin(key.type) is dict:  # set by override only: named in the epilog
            assert key.path in help_text and "".join(key.doc.split()) in flat, key.path
            continue
        assert flag_name(key.path) in help_text, key.path
        assert "".join(key.doc.split()) in flat, key.path


# ----------------------------------------------------------------------------- training.train


def test_train_help_documents_every_config_field() -> None:
    text = train_parser().format_help()
    _documents_every_field(text, Config)
    for flag in ("--config", "--run-dir", "--data", "--resume", "--no-progress", "--prepare-only"):
        assert flag in text
    assert "--train.no-compile-dense" in text  # booleans can be turned off


def test_train_misspelled_key_is_one_line_with_a_suggestion() -> None:
    proc = run_train(["--config", TINY, "train.max_stesp=3"], nproc=0, check=False)
    line = _only_error(proc)
    assert "unknown key 'train.max_stesp'" in line and "did you mean 'train.max_steps'" in line


def test_train_file_then_flags_then_overrides(tmp_path: Path) -> None:
    cfg_file = tmp_path / "mine.toml"
    cfg_file.write_text('[train]\nmax_steps = 5\neval_every = 3\n[model]\narch = "dlrm_dcn"\n')
    args = parse_args(
        [
            "--config", str(cfg_file), "--train.max-steps", "7", "--train.compile-dense",
            "--optim.dense-lr=0.5", "train.eval_every=4", "--data", "x.tsv",
            "data.path=ignored.tsv",
        ]
    )  # fmt: skip
    t = args.config.train
    assert (t.max_steps, t.eval_every, t.compile_dense) == (7, 4, True)
    assert args.config.model.arch == "dlrm_dcn" and args.config.optim.dense_lr == 0.5
    assert args.config.data.path == "x.tsv"  # --data wins over data.path
    assert args.config.name == "mine" and args.run_dir == Path("runs/mine")
    later = parse_args(
        ["--config", str(cfg_file), "--train.compile-dense", "--train.no-compile-dense"]
    )
    assert later.config.train.compile_dense is False  # the last of a flag pair wins
    named = parse_args(["--config", str(cfg_file), "--name", "exp1"])
    assert named.config.name == "exp1" and named.run_dir == Path("runs/exp1")


@pytest.mark.slow
def test_train_prepare_only_takes_a_config_file_and_overrides(
    tmp_path: Path, data_dirs: list[str]
) -> None:
    cfg_file = tmp_path / "small.toml"
    cfg_file.write_text(Path(ROOT / TINY).read_text().replace("20000", "4000"))
    proc = run_train(
        ["--config", str(cfg_file), "--prepare-only", "--run-dir", str(tmp_path / "run"),
         *data_dirs, "--data.synthetic-vocab", "50"],
        nproc=0,
    )  # fmt: skip
    assert proc.returncode == 0
    cache = Path(data_dirs[1].split("=", 1)[1].strip('"'))
    assert any("r4000_v50" in p.name for p in cache.iterdir()), list(cache.iterdir())


# ----------------------------------------------------------------------------- training.export


def test_export_help_documents_every_field_and_keeps_the_flag_spellings() -> None:
    text = export_parser().format_help()
    _documents_every_field(text, ExportConfig)
    for flag in (
        "--run-dir", "--checkpoint", "--formats", "--cpu-variant", "--name", "--version",
        "--model-store", "--handler", "--parity-rows", "--eval-data", "--force", "--overwrite",
        "--no-progress", "--no-archive", "--config", "--latency", "--memory-budget",
    ):  # fmt: skip
        assert flag in text, flag
    assert "{int8,int4,fp16,fp32,torchscript,portable,pt2,onnx,aoti}" in text


def test_export_config_file_flags_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "export.toml"
    f.write_text(
        'run_dir = "runs/a"\nformats = ["fp16", "onnx"]\ncpu_variant = "fp16"\n'
        'parity_rows = 100\nname = "m"\n'
    )
    cfg = export_args(["--config", str(f), "--no-archive", "--version", "3", "parity_rows=50"])
    assert cfg.run_dir == Path("runs/a") and cfg.formats == ["fp16", "onnx"] and cfg.name == "m"
    assert cfg.cpu_variant == "fp16"
    assert cfg.archive is False and cfg.version == "3" and cfg.parity_rows == 50
    assert cfg.progress is True and cfg.model_store == Path("model_store")
    default = export_args(["--checkpoint", "c"])
    assert default.formats == ["int8", "fp16", "fp32"] and default.cpu_variant == "int8"
    ts = export_args(["--checkpoint", "c", "--formats", '["torchscript"]', "cpu_variant=ts_int8"])
    assert ts.formats == ["torchscript"] and ts.cpu_variant == "ts_int8"


def test_export_misspelled_key_and_bad_choice_are_one_line(capsys: typing.Any) -> None:
    line = _in_process(export_main, ["--run-dir", "runs/x", 'fromats=["int8"]'], capsys)
    assert "unknown key 'fromats'" in line and "did you mean 'formats'" in line
    line = _in_process(export_main, ["--run-dir", "runs/x", "--formats", '["int2"]'], capsys)
    assert (
        "formats[0] = 'int2': must be one of 'int8', 'int4', 'fp16', 'fp32', 'torchscript'" in line
    )
    # the CPU variant must be one the formats write
    line = _in_process(export_main, ["--run-dir", "runs/x", "--cpu-variant", "ts_int8"], capsys)
    assert "cpu_variant = ts_int8: the formats written give" in line and "int8" in line
    line = _in_process(export_main, [], capsys)
    assert "give --run-dir or --checkpoint" in line


# ----------------------------------------------------------------------------- training.bench


def test_bench_help_and_misspelled_key(capsys: typing.Any) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    _documents_every_field(text, Config)
    for flag in ("--max-rows", "--batch-size", "--steps", "--repeats", "--json", "--no-progress"):
        assert flag in text
    line = _in_process(bench_main, ["--max-rows=10", "model.embeding_dim=8"], capsys)
    assert "did you mean 'model.embedding_dim'" in line
