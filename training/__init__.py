"""Training stage: data, sharded DLRM on TorchRec, checkpoints, export."""
