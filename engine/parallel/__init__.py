"""Tensor parallelism over ``torch.distributed``: the process group, weight
sharding and the executor that keeps the worker ranks in step with the engine."""
