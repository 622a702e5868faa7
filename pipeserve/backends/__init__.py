"""Attention backends: the one interface through which every layer reaches its kernels.

A model runner picks one backend per run (`registry.select_backend`, logged once); the
backend plans each batch's attention (`plan`, on the host, into its own metadata class),
runs it for every layer (`attend`), and offers the layers the other per-device kernels it
owns (RMSNorm with its residual add, rotary with the KV write, MLA's batched latent decode,
a compiled dense prefill kernel). A backend that can be captured in a CUDA graph owns its
persistent buffers (`graph_buffers`). See base.py for the interface; each other module is
one backend.
"""
