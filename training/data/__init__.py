"""Criteo data: TSV reading (``criteo``), synthetic data (``synthetic``), binary shards
(``binary``), the data a run prepares (``prep``) and the batches it trains on (``loader``)."""
