"""A lighter backend beside TorchServe: the stack's handler in one Python process per worker,
no Java frontend and no frontend-to-worker hop, behind TorchServe's gRPC inference API and the
same calls on a Unix socket (serving/lite/frames.py).

``python -m serving.lite MAR`` (serving/lite/__main__.py) unpacks a ``.mar`` as TorchServe
would and starts its workers (serving/lite/worker.py); the gateway calls them as it calls
TorchServe replicas (``[gateway] backend`` = their sockets, ``lite:PATH``, or their gRPC
addresses; ``key_file`` their key files).
TorchServe stays the default and the documented path: it has the management API that
rollouts, scaling and ``make status`` use; this backend serves one model version, fixed at
start (embedding deltas included), and is measured beside TorchServe by ``python -m
serving.bench`` (method ``gateway-lite``).
"""

from typing import Any

# What the gateway in front of one machine's lite workers sets besides its backend: hedging
# off. The workers share the machine's cores, so a hedged copy of a slow call only doubles
# the work (serving/lite/__main__.py has the figures).
GATEWAY_SETTINGS: dict[str, Any] = {"hedge": {"ratio": 0.0}}
