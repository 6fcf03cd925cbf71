"""What runs inside a TorchServe worker: the handler, the scorer it loads, the portable model.

``codec`` is the binary body both sides speak; the gateway imports it too (numpy only). These
files are archived flat beside the handler in each ``.mar`` (TorchServe puts them on the
worker's path), so they import each other by bare name there and by package name elsewhere.
``features`` holds the raw-feature transforms every scorer calls (training's loader too).
"""
