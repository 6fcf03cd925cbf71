"""``python -m training.sweep --preset tiny --trials 8`` (``make sweep``): parse, sweep, report.

Exit codes: 0 when the sweep ran (or had nothing left to run) and wrote its report; 2 for a bad
config, or the preset's ``--prepare-only`` exit code when it refused the data; 130 when
interrupted (the report is written first; the same command continues).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from recsys_stack import logs
from training.errors import RecsysError
from training.sweep.options import SweepArgs, parse_args

logger = logging.getLogger("training.sweep")
EXIT_INTERRUPTED = 128 + signal.SIGINT


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # scancel / kill: end the trials as a Ctrl-C does


def main(argv: Sequence[str] | None = None) -> int:
    logs.configure(logging.INFO, verbose=logs.verbose_requested())
    try:
        args = parse_args(argv)
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    from training.sweep import report
    from training.sweep.study import PrepareFailed, run_sweep

    study = None
    try:
        study, _ = run_sweep(args)
    except PrepareFailed as e:
        return e.code  # it said why, in one line
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: sweep interrupted; the running trials were stopped and are not counted: "
              f"{resume_hint(args)}", file=sys.stderr)  # fmt: skip
        from training.sweep.study import open_study

        report.write(args, open_study(args))
        return EXIT_INTERRUPTED
    summary = report.write(args, study)
    for line in summary["lines"]:
        logger.info("%s", line)
    logger.info("report: %s", summary["report"])
    logger.info("plot: %s", summary["plot"])
    if summary.get("best_toml"):
        logger.info("best config: %s (train it: python -m training.train --config %s)",
                    summary["best_toml"], summary["best_toml"])  # fmt: skip
    return 0


def resume_hint(args: SweepArgs) -> str:
    """How to continue this sweep."""
    return (f"the same command continues study {args.study_name} "
            f"({args.config.storage or args.out / 'study.journal'})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
