"""TorchServe for one model archive, split by concern.

* ``config``: :class:`~serving.torchserve.config.TorchServeConfig` (ports, model, batching; the
  ``RECSYS_TS_*`` variables), the archive it serves and the ``config.properties`` it writes;
* ``process``: start, readiness and stop of TorchServe's process group (psutil);
* ``keys``: the one reader of TorchServe's ``key_file.json`` (token authorization);
* ``client``: the one builder of gRPC ``PredictionsRequest`` calls.

``keys`` and ``client`` import neither torch nor psutil: the gateway uses them.
Start and stop it with the supervisor (``python -m serving.tools.supervisor``, ``make serve``).
"""
