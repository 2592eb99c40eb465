"""KV policies: which of a sequence's tokens its KV cache keeps (issue 17).

One ABC (:class:`base.KVPolicy`) decides a keep-set from an
:class:`base.EvictionContext`; :mod:`vote` is the one implementation, a
weighted vote of scorers, and ``streaming`` / ``h2o`` / ``rkv`` /
``segmented`` are configurations of it (:func:`vote.make_policy`).
:mod:`runtime` applies a keep-set to the paged cache (compaction and
re-rotation); :mod:`resolve` turns the server setting and a request's
``kv_policy`` extension into a per-request policy.
"""
