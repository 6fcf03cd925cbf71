"""Training benchmarks: what the trainer's step costs, and how preprocessing and training scale.

``python -m training.bench`` (``make bench``): :mod:`~training.bench.run` times the trainer's
step against the raw DMP step and a plain PyTorch DLRM, built by :mod:`~training.bench.steppers`.
``python -m training.bench.scale`` (``make bench-scale``): :mod:`~training.bench.scale` times
preprocessing and training at the Kaggle shape, reported by :mod:`~training.bench.scale_report`.
Nothing here runs in a training job; each module is its own process.
"""
