"""Plain-PyTorch attention over the paged KV cache (CPU and CUDA).

Decode sequences (query length 1) are attended in one batched
``scaled_dot_product_attention`` call over their gathered, padded contexts.
Prefill/extend chunks are attended one sequence per call: their query lengths
differ, and padding a 512-token chunk to share a call with 1-token decodes
would waste more than the loop costs (a step holds few prefill chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into their cache slots (slots < 0 are skipped)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kc = k_cache.view(-1, num_kv_heads, head_dim)
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, v.to(vc.dtype))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, block_size)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._extend(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta, i, scale, block_size
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        block_size: int,
    ) -> torch.Tensor:
        nd = q.shape[0]
        max_len = max(meta.seq_lens_cpu[:nd])
        nblk = (max_len + block_size - 1) // block_size
        bt = meta.block_tables[:nd, :nblk].long()
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        # [nd, nblk, bs, Hkv, D] -> [nd, Hkv, S, D]
        kk = k_cache[bt].reshape(nd, nblk * block_size, hkv, d).transpose(1, 2)
        vv = v_cache[bt].reshape(nd, nblk * block_size, hkv, d).transpose(1, 2)
        pos = torch.arange(nblk * block_size, device=q.device)
        mask = (pos[None, :] < meta.seq_lens[:nd, None]).view(nd, 1, 1, -1)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(kk.dtype), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2).to(q.dtype)

    @staticmethod
    def _extend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
        block_size: int,
    ) -> torch.Tensor:
        qlen = q.shape[0]
        seq_len = meta.seq_lens_cpu[i]
        ctx = seq_len - qlen
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if ctx == 0:
            # Whole sequence is new: attend over the fresh k/v, no gather.
            kt = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
            vt = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            nblk = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[i, :nblk].long()
            hkv, d = k_cache.shape[2], k_cache.shape[3]
            kt = k_cache[blocks].reshape(-1, hkv, d)[:seq_len].transpose(0, 1).unsqueeze(0)
            vt = v_cache[blocks].reshape(-1, hkv, d)[:seq_len].transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ctx, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                qt.to(kt.dtype), kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
            ).to(q.dtype)
        return o.squeeze(0).transpose(0, 1)
