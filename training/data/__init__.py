"""Criteo data: TSV reading (``criteo``), synthetic data (``synthetic``), binary shards (``binary``)."""
