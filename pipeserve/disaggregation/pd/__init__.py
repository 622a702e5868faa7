"""Prefill/decode disaggregation (spec 05). Built so far: kv_remap.py, which prefill rank
sends which layers and KV heads of a request to which decode rank when the sides' layouts
differ. The servers, router and transfer backends are not built yet."""
