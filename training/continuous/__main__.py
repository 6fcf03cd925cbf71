"""``torchrun --nproc_per_node=N -m training.continuous --run-dir RUN --data-dir DIR [--follow]``
(``make continuous``, ``recsys-continuous``): see :mod:`training.continuous.file_loop`."""

from __future__ import annotations

if __name__ == "__main__":  # a bad config in one line before torch's import
    from training.continuous.config import parse_args as _parse
    from training.launch import check_early

    check_early(_parse)

import json
import os
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist

from recsys_stack import logs
from training.continuous.config import parse_args
from training.errors import RecsysError
from training.train import configure_logging, setup_distributed


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank, verbose=logs.verbose_requested())
    try:
        args = parse_args(argv)
        rank, world, device = setup_distributed()
        from training.continuous.file_loop import Continuous

        loop = Continuous(args, rank, world, device)
        summary = loop.run()
        if rank == 0:
            from training.continuous.figure import draw

            curves = draw(loop.run_dir, None, loop.run_dir / "curves.png")  # progressive AUC
            print(json.dumps({**summary, "curves": str(curves)}))
        code = loop.outcomes.exit_code()  # every publish failed: said, with the fix (.served)
        if code and rank == 0:
            fixes = "; ".join(dict.fromkeys(loop.outcomes.fixes))
            print(f"error: every publish of this run failed ({summary['publish']['failed']}; "
                  f"continuous.require_publish=false to exit 0): fix: {fixes}", file=sys.stderr)  # fmt: skip
        return code
    except RecsysError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        else:  # every rank fails alike: give rank 0 the time to say why before torchrun stops it
            time.sleep(2.0)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
