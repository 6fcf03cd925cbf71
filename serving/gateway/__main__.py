"""``python -m serving.gateway``: the gateway (see ``serving.gateway.server``)."""

import os
import sys

# grpc-core reads its level once, when grpc is imported: ERROR keeps the one INFO line it
# writes per failed TLS handshake out of the log (serving/gateway/logs.py)
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from serving.gateway.server import main  # after the level is set

sys.exit(main())
