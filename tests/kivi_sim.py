"""A paged KIVI cache driven step by step outside the engine (kernel tests).

Sequences get shuffled block ids; each step stores chunks of some sequences
through ``kernels.kivi.kivi_store`` and builds the step's ``AttentionMetadata``,
so every kernel can be run over exactly what the engine would hand it, and
compared with ``kivi_attention_dense_ref`` on the sequences' float16 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata
from kernels.kivi import KiviLayout, KiviStorePlan, kivi_store, side_views


@dataclass
class SimSeq:
    k: torch.Tensor  # [L, H, D] float32: every token this sequence will have
    v: torch.Tensor
    q: torch.Tensor  # [L, Hq, D]
    blocks: list[int]
    done: int = 0


@dataclass
class KiviSim:
    lay: KiviLayout
    num_heads: int
    seqs: list[SimSeq] = field(default_factory=list)
    k_cache: torch.Tensor = field(init=False)
    v_cache: torch.Tensor = field(init=False)

    @classmethod
    def make(cls, lay: KiviLayout, num_heads: int, lengths: list[int], seed: int = 0) -> KiviSim:
        gen = torch.Generator().manual_seed(seed)
        sim = cls(lay, num_heads)
        bs = lay.block_size
        need = sum(-(-n // bs) for n in lengths)
        perm = torch.randperm(need + 3, generator=gen).tolist()
        h, d = lay.num_kv_heads, lay.head_dim
        for n in lengths:
            nb = -(-n // bs)
            blocks, perm = perm[:nb], perm[nb:]
            # A few outlier channels in the keys, as real keys have.
            k = torch.randn(n, h, d, generator=gen)
            k[..., :2] *= 6.0
            sim.seqs.append(
                SimSeq(
                    k=k,
                    v=torch.randn(n, h, d, generator=gen),
                    q=torch.randn(n, num_heads, d, generator=gen),
                    blocks=blocks,
                )
            )
        sim.k_cache = torch.zeros(need + 3, lay.k.nbytes, dtype=torch.uint8)
        sim.v_cache = torch.zeros(need + 3, lay.v.nbytes, dtype=torch.uint8)
        return sim

    def step(
        self, chunks: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(q, k, v, meta) of a step computing ``n`` more tokens of each ``(seq, n)``
        (decodes, n == 1, must come first). Nothing is stored: the caller's
        kernel stores. Advances the sequences."""
        bs = self.lay.block_size
        qs, ks, vs, slots, qlens, lens = [], [], [], [], [], []
        width = max(len(self.seqs[i].blocks) for i, _ in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (i, n) in enumerate(chunks):
            s = self.seqs[i]
            a, b = s.done, s.done + n
            qs.append(s.q[a:b])
            ks.append(s.k[a:b])
            vs.append(s.v[a:b])
            slots += [s.blocks[p // bs] * bs + p % bs for p in range(a, b)]
            qlens.append(n)
            lens.append(b)
            table[row, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
            s.done = b
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        nd = 0
        while nd < len(qlens) and qlens[nd] == 1:
            nd += 1
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(qlens),
            max_seq_len=max(lens),
            num_decodes=nd,
            query_lens_cpu=qlens,
            seq_lens_cpu=lens,
            query_start_loc_cpu=qsl,
            kv_layout=self.lay,
        )
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), meta

    def store(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        plan = KiviStorePlan.build(meta.slot_mapping, self.lay)
        ks, vs = side_views(self.k_cache, self.lay, True), side_views(self.v_cache, self.lay, False)
        kivi_store(k, v, ks, vs, plan, self.lay)
