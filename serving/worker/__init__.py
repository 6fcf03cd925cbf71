"""What runs inside a TorchServe worker: the handler and the scorer it loads.

``codec`` is the binary body both sides speak; the gateway imports it too (numpy only). These
files are archived flat beside the handler in each ``.mar`` (TorchServe puts them on the
worker's path), so they import each other by bare name there and by package name elsewhere.
The model's own files (the transforms, the portable scorer, the mapped tables) come from
``recsys_model``, which training imports too; they are archived beside these.
"""
