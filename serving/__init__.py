"""Serving stage: TorchServe (handler, supervision) and the torch-free gRPC gateway and client.

Never imports training/: what they share is the exported artifact and its schema file.
"""
