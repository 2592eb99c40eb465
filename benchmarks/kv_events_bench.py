"""Cost of collecting KV cache events in the block pool (engine/kv/events.py).

Caches a chain of ``--blocks`` full blocks, frees them and evicts every one,
with events off and on, alternating the two in each of ``--rounds`` rounds
(best of each reported), then encodes the collected events as one batch (the
publisher thread's work, off the step). Usage::

    python -m benchmarks.kv_events_bench --blocks 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import time

import msgspec

from engine.kv.block_pool import BlockPool, hash_block
from engine.kv.events import KVEventBatch, KVEventCollector

BS = 16


def run(chain: list[tuple[bytes, list[int]]], events: bool) -> tuple[float, float]:
    """(seconds for cache + free + evict of the chain, seconds to encode its events)."""
    n = len(chain)
    pool = BlockPool(n)
    pool.events = KVEventCollector(BS) if events else None
    blocks = [pool.allocate() for _ in range(n)]
    t = time.perf_counter()
    parent: bytes | None = None
    for b, (key, toks) in zip(blocks, chain):
        pool.cache(b, key, toks, parent)
        parent = key
    for b in blocks:
        pool.free(b)
    for _ in range(n):
        pool.allocate()  # every allocation evicts a cached block
    dt = time.perf_counter() - t
    if pool.events is None:
        return dt, 0.0
    t = time.perf_counter()
    msgspec.msgpack.encode(KVEventBatch(0.0, pool.events.take(), 0))
    return dt, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    chain: list[tuple[bytes, list[int]]] = []
    key: bytes | None = None
    for i in range(args.blocks):
        toks = list(range(i * BS, (i + 1) * BS))
        key = hash_block(key, toks)
        chain.append((key, toks))
    off: list[float] = []
    on: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        off.append(run(chain, False)[0])
        on.append(run(chain, True))
    t_off, t_on = min(off), min(d for d, _ in on)
    enc = min(e for _, e in on)
    n = args.blocks
    print("| blocks | off ms | on ms | on/off | collect us/block | encode us/block |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {n} | {t_off * 1e3:.1f} | {t_on * 1e3:.1f} | {t_on / t_off:.2f} | "
        f"{(t_on - t_off) / n * 1e6:.2f} | {enc / n * 1e6:.2f} |"
    )


if __name__ == "__main__":
    main()
