"""Operator tools, each its own short-lived process: the supervisor (``make serve``/``stop``/
``status``), the client (``make score``), evaluation, rollout and the GPU check."""
