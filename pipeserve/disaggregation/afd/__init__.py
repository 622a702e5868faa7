"""Attention-FFN disaggregation: attention (A) workers route their tokens to the routed
experts on FFN (F) workers. routing.py plans dispatch and combine (direct, per-rank and
two-stage) and counts the bytes each link class carries."""
