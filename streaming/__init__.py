"""The stream stage of the closed loop: the Flink job joining the gateway's impression and click
logs into labelled rows for the continuous trainer (:mod:`streaming.joiner`).

It runs in an environment of its own (``make flink-setup``: ``.venv-flink`` from
``requirements/flink.lock.txt``), because PyFlink pins protobuf, grpcio and numpy apart from the
training and serving lock. So it imports only the standard-library parts of the bottom layer
(:mod:`recsys_stack.online`, :mod:`recsys_stack.config`, :mod:`recsys_model.atomic`) and pyflink;
nothing of ``training`` or ``serving``, and nothing imports it. :mod:`streaming.mover` and
:mod:`streaming.config` are standard library only, so the main environment's tests read them too.
"""
