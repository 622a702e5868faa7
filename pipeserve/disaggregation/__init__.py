"""Disaggregated serving: roles that run on separate workers (afd/: attention and routed
experts on separate workers)."""
