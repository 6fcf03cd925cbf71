"""How the training stages start: torchrun quiet when interrupted, and the console scripts.

``python -m training.launch <torchrun arguments>`` is torchrun, quiet when interrupted.

``make train`` starts its process group through here. On Ctrl-C (SIGINT to the whole
foreground group) torchrun stops its ranks and then raises its ``SignalException`` with a
traceback, after two warnings per rank; the ranks have already said what survived and how to
resume (:mod:`training.checkpoint.interrupt`), so this exits with ``128 + signal`` (130 for Ctrl-C)
without them. Everything else is torchrun's own behaviour, failure reports included.

The console scripts (``recsys-train``, ``recsys-continuous``, ``recsys-bench-training``) answer
``--help`` with the stage's own torch-free parser before anything imports torch, TorchRec and
fbgemm (5-6 s of CPU, 20 s on a busy 2-core machine, only to print options); every other command
line goes to the stage's ``main``, which parses it again and does the work (its errors and exit
codes are the stage's own).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from recsys_stack import logs

T = TypeVar("T")

# torchrun's loggers that narrate a shutdown on a signal ("Received 2 death signal, shutting
# down workers", then "Sending process N closing signal SIGINT" per rank)
SHUTDOWN_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)


class QuietAfterSignal(logging.Filter):
    """Drops torchrun's records from its "death signal" record on: a shutdown asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.signalled = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.signalled = self.signalled or "death signal" in record.getMessage()
        return not self.signalled


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    if not logs.verbose_requested():
        quiet = QuietAfterSignal()
        for name in SHUTDOWN_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
    try:
        torchrun(list(argv) if argv is not None else None)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


HELP = ("-h", "--help")


def check_early(parse: Callable[[list[str]], T]) -> T:
    """For a stage run as ``python -m``, before its module imports torch (5-10 s of CPU, minutes
    on a loaded machine): ``parse`` (the stage's torch-free parser) this process's arguments,
    and a bad config is one line and exit 2 at once (from rank 0 only under torchrun). A good
    one is parsed again by the stage's ``main``; ``--help`` answers here."""
    import os

    from training.errors import RecsysError

    try:
        return parse(sys.argv[1:])
    except RecsysError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def first_run_note(args: Any) -> None:
    """``--prepare-only``'s first line when it will generate the data (a first ``make train``
    was 89 s of silence at load): what, where, how large, about how long."""
    from training.data.first_run import first_run_note as note_of

    if getattr(args, "prepare_only", False) and (note := note_of(args.config.data)):
        print(note, file=sys.stderr, flush=True)


def _stage(argv: Sequence[str] | None, parse: Callable[[list[str]], object], module: str) -> int:
    """``module.main(argv)``, after ``parse(argv)`` has printed the help (and exited 0) when
    ``argv`` asks for it: ``parse`` is the stage's torch-free parser, ``module`` imports torch."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in HELP for a in args):
        parse(args)
    main: Callable[[Sequence[str] | None], int] = importlib.import_module(module).main
    return main(argv)


def train(argv: Sequence[str] | None = None) -> int:
    """``recsys-train``: :func:`training.train.main`."""
    from training.config import parse_args

    return _stage(argv, parse_args, "training.train")


def continuous(argv: Sequence[str] | None = None) -> int:
    """``recsys-continuous``: :func:`training.continuous.__main__.main`."""
    from training.continuous.config import parse_args

    return _stage(argv, parse_args, "training.continuous.__main__")


def bench(argv: Sequence[str] | None = None) -> int:
    """``recsys-bench-training``: :func:`training.bench.run.main`."""
    from training.bench.options import build_parser

    return _stage(argv, build_parser().parse_intermixed_args, "training.bench.run")


if __name__ == "__main__":
    sys.exit(main())
