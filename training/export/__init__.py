"""Export: a training checkpoint -> self-contained TorchScript variants, schema, parity, .mar."""
