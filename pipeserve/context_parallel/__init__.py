"""Context parallelism: a prefill chunk's tokens split over CP ranks (zigzag.py), and the
planning of shard linear (shard_linear.py)."""
