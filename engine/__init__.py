"""Fuel Serve's engine: requests, scheduler, KV cache manager, model runner, models, sampling.

Nothing in this package imports ``server``.
"""
