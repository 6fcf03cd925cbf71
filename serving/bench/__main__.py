import sys

from serving.bench.run import main

sys.exit(main())
