"""Logging for every command of ours, and the one list of third-party noise we silence.

A user reads our lines; the libraries' own chatter (per table, per rank, per pass) hides them.
:func:`configure` is called once by each entry point that imports torch, after it does (torch's
import sets the levels of its loggers, undoing ours). Unless
``RECSYS_VERBOSE=1``, it drops what is listed below and nothing else; each entry says why it is
harmless here. Everything at ERROR or above always shows.

Loggers below ERROR (records from their packages are dropped by a filter on our handlers too,
since some of them log through the root logger):

- ``torch``, ``torchrec``, ``fbgemm_gpu``: per-table planner and sharding notes on every rank,
  and fbgemm's ``Successfully loaded: '<lib>.so'`` line for each of its ~15 libraries.
- ``torch.onnx``, ``onnx_ir``, ``onnxscript``: the ONNX exporter's per-pass notes and
  ``torchvision is not installed. Skipping torchvision::nms`` (we export no torchvision op).

Warnings:

- any warning raised from inside torch, torchrec or fbgemm_gpu (the deprecation of
  ``torch.jit`` among them: TorchScript is a format we ship on purpose, see docs/contracts.md);
- ``isinstance(treespec, LeafSpec)`` is deprecated: torch's pytree pickling, raised through
  ``copyreg`` (so no torch module to match on);
- ``The TorchScript type system ...``: scripting TorchRec classes, raised through ``ast``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable

LIBRARY_LOGGERS = ("torch", "torchrec", "fbgemm_gpu", "torch.onnx", "onnx_ir", "onnxscript")
_LIBRARY_PATH = re.compile(r"[/\\](torch|torchrec|fbgemm_gpu|onnx_ir|onnxscript)[/\\]")
_WARNINGS = (  # (message regex, module regex) pairs of warnings.filterwarnings
    ("", r"(torch|torchrec|fbgemm_gpu)(\.|$)"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", ""),
    ("The TorchScript type system", ""),
    # TorchRec's checkpoints hold ShardedTensors; torch warns at every resume, from our frame
    ("Please use DTensor instead and we are deprecating ShardedTensor", ""),
)


def verbose_requested() -> bool:
    """``RECSYS_VERBOSE`` set to anything but empty or 0."""
    return os.environ.get("RECSYS_VERBOSE", "") not in ("", "0")


def quiet_library(record: logging.LogRecord) -> bool:
    """A handler filter: drop library records below ERROR, whatever logger they went through."""
    return record.levelno >= logging.ERROR or not _LIBRARY_PATH.search(record.pathname)


def configure(
    level: int = logging.INFO,
    fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
    verbose: bool | None = None,
) -> None:
    """Our records at ``level`` on stderr; the libraries' noise listed above only if verbose."""
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=True)
    if verbose_requested() if verbose is None else verbose:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet_library)
    for name in LIBRARY_LOGGERS:  # torch._logging gives "torch" a handler of its own
        logging.getLogger(name).setLevel(logging.ERROR)
    for message, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)


class OncePer:
    """Lets one log line through per ``period_s``; counts the ones it held back."""

    def __init__(self, period_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.period_s, self.clock = period_s, clock
        self.next, self.held = -math.inf, 0

    def ready(self) -> int | None:
        """None: stay quiet; else log now, with this many held back since the last line."""
        now = self.clock()
        if now < self.next:
            self.held += 1
            return None
        held, self.held, self.next = self.held, 0, now + self.period_s
        return held
