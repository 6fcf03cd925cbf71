"""``python -m serving.gateway``: the gateway (see ``serving.gateway.server``)."""

import sys

from serving.gateway.server import main

sys.exit(main())
