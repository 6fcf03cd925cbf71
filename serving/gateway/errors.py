"""Errors every API of the gateway reports with the same gRPC status code."""

from __future__ import annotations

import grpc


class ScoreError(Exception):
    """A scoring call that failed, with the gRPC status code every API reports it as."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
