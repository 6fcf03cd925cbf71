"""The gateway process: everything that runs inside ``python -m serving.gateway``.

The process (``server``), its gRPC front doors (``ranker``: ``recsys.v1.Ranker`` and the scoring
path; ``kserve``: KServe v2), the request contract
(``validate``, ``wire``, ``varint``; REST bodies: ``kserve_json``), admission, coalescing,
backends, auth (token files' modes: ``filemode``), metrics, the serving plan, the config and
the process's heap (``memory``). Imports neither torch nor ``training/``;
nothing heavy at import.
"""
