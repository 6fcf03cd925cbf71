"""Serving stage: TorchServe handler and (later) the gRPC gateway. Never imports training/."""
