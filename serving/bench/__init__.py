"""Serving benchmark (``python -m serving.bench``, part of ``make bench``).

In one run, on one model and one machine, interleaved (within each round every cell runs every
method in turn, so machine noise hits all alike), for requests of ``--sizes`` examples at
``--concurrency`` client threads (closed loop, one connection each):

* ``in-process``: the TorchScript file the .mar serves, one forward per request, a worker's
  threads, one caller (the floor);
* ``plain-torchserve``: the peer as its users run it by default: REST + JSON, a ~30-line
  ``BaseHandler`` (``plain_handler.py``), TorchServe's default workers (= cores), no batching;
* ``torchserve-grpc``: TorchServe's gRPC ``Predictions`` with this project's handler and RSB1
  body, the TorchServe settings ``make serve`` uses, no gateway;
* ``gateway``: the full path, ``recsys.v1.Ranker/Score`` on the gateway -> TorchServe.

Modules: ``config`` (BenchConfig), ``model`` (build the model, the requests), ``servers``
(start and stop both TorchServes and the gateway), ``methods`` (one client per method),
``measure`` (closed-loop cells), ``report`` (ratios, table), ``run`` (main).
"""

from serving.bench.run import main

__all__ = ["main"]
