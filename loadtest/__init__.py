"""Fuel Serve's load tester: benchmarks any OpenAI-compatible server on loopback.

``python -m loadtest run ...`` benchmarks one server; ``python -m loadtest
compare ...`` runs Fuel Serve and llama.cpp's server side by side. The metric
definitions (vLLM's) live in ``loadtest.metrics``.
"""
