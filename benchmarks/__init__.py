"""In-process benchmarks: they import the engine and kernels directly.

The load tool (``loadtest/``) talks HTTP only; anything that builds an engine,
a model or a kernel in the same process lives here. Results go to
``docs/benchmarks/`` with the command that produced them.
"""
