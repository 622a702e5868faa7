"""Prefill/decode disaggregation (spec 05): `kv_remap` (which prefill rank sends which layers
and KV heads to which decode rank when the layouts differ), `transfer` (the transfer engine:
senders on prefill workers, receivers on decode workers, the decode engine's control of
them), `decode_side` (a decode server's reserved requests until their KV and first token
are in), `http` (the decode server's call of a prefill server) and `router` (the OpenAI
front end that pairs them)."""
