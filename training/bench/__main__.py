"""``python -m training.bench``: the step benchmark (:mod:`training.bench.run`)."""

import sys

from training.bench.run import main

sys.exit(main())
