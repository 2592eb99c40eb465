"""Block copies for the KV tiers on the CPU: the format's numpy row gathers vs torch's.

``PlainKVFormat.read_blocks`` / ``write_blocks`` and the host tier's row
copies use numpy on the CPU (engine/kv/format.py says why). This measures
gathering and scattering ``--blocks`` blocks of the default model's layout
(30 layers, 3 KV heads, head_dim 64, 16-token blocks) both ways, alternating,
at the engine's thread count, and prints the medians.

    python -m benchmarks.kv_copy_bench --blocks 32 --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.kv.format import PlainKVFormat


def torch_read(
    fmt: PlainKVFormat, caches: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor
) -> torch.Tensor:
    parts = []
    for k, v in caches:
        parts.append(k.view(k.shape[0], -1).index_select(0, ids))
        parts.append(v.view(v.shape[0], -1).index_select(0, ids))
    return torch.stack(parts, dim=1).reshape(len(ids), -1).view(torch.uint8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    fmt = PlainKVFormat(30, 16, 3, 64, dtype)
    caches = fmt.allocate(4 * a.blocks, torch.device("cpu"))
    for k, v in caches:
        k.normal_()
        v.normal_()
    ids = torch.randperm(2 * a.blocks)[: a.blocks]
    dst = ids + 2 * a.blocks
    out = torch.empty((a.blocks, fmt.block_nbytes), dtype=torch.uint8)
    times: dict[str, list[float]] = {
        "torch gather": [],
        "numpy gather": [],
        "numpy scatter": [],
        "torch scatter": [],
    }
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        want = torch_read(fmt, caches, ids)
        t1 = time.perf_counter()
        got = fmt.read_blocks(caches, ids, out=out)
        t2 = time.perf_counter()
        fmt.write_blocks(caches, dst, got)
        t3 = time.perf_counter()
        elems = want.view(dtype).view(a.blocks, 30, 2, -1)
        for layer, (k, v) in enumerate(caches):
            k.view(k.shape[0], -1).index_copy_(0, dst, elems[:, layer, 0])
            v.view(v.shape[0], -1).index_copy_(0, dst, elems[:, layer, 1])
        t4 = time.perf_counter()
        assert torch.equal(want, got)
        times["torch gather"].append(t1 - t0)
        times["numpy gather"].append(t2 - t1)
        times["numpy scatter"].append(t3 - t2)
        times["torch scatter"].append(t4 - t3)
    mb = a.blocks * fmt.block_nbytes / 1e6
    try:
        load = Path("/proc/loadavg").read_text().strip()
    except OSError:
        load = "?"
    print(
        f"{a.blocks} blocks ({mb:.1f} MB), {a.dtype}, torch threads {torch.get_num_threads()}, load {load}"
    )
    for name, ts in times.items():
        print(
            f"  {name:14s} median {statistics.median(ts) * 1e3:8.2f} ms  min {min(ts) * 1e3:8.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
