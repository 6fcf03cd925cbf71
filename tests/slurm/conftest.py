"""The Slurm tests start their runs cold: a job's processes are Slurm's (its cgroup, its
environment), not stand-ins for the suite's warm Python (``tests/warm.py``)."""

from __future__ import annotations

import os

from tests import warm

os.environ.pop(warm.SOCK_ENV, None)
