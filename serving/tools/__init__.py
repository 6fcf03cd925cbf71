"""Operator tools, each its own short-lived process: the supervisor (``make serve``/``stop``/
``status``), the client (``make score``), evaluation, rollout and the GPU check; ``channel``: how
each of them (and the healthcheck and the load test) reaches the gateway."""
