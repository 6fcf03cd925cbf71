"""What the model artifact is, shared by the stage that writes it and the one that serves it.

``features`` holds the raw-feature transforms every path calls (training's loader, the exported
scorers, the portable scorer); ``portable_model`` the TorchRec-free scorer training builds and a
worker loads; ``mapped`` the on-disk table format export writes and workers map. training/ and
serving/worker/ both import this package; it imports neither (torch only). The export archives
these files flat beside the handler in each ``.mar`` (TorchServe puts them on the worker's path),
so they import each other by bare name there and by package name elsewhere.
"""
