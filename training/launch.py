"""``python -m training.launch <torchrun arguments>``: torchrun, quiet when interrupted.

``make train`` starts its process group through here. On Ctrl-C (SIGINT to the whole
foreground group) torchrun stops its ranks and then raises its ``SignalException`` with a
traceback, after two warnings per rank; the ranks have already said what survived and how to
resume (:mod:`training.checkpoint.interrupt`), so this exits with ``128 + signal`` (130 for Ctrl-C)
without them. Everything else is torchrun's own behaviour, failure reports included.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from recsys_stack import logs

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


if __name__ == "__main__":
    sys.exit(main())
