"""The gateway process: everything that runs inside ``python -m serving.gateway``.

gRPC front doors (``server``: ``recsys.v1.Ranker``; ``kserve``: KServe v2), the request contract
(``validate``, ``wire``), admission, coalescing, backends, auth, metrics, the serving plan and the
config. Imports neither torch nor ``training/``; nothing heavy at import.
"""
