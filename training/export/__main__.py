import sys

from training.export.cli import main

sys.exit(main())
