"""A decode-only step's whole decoder stack in one native call (CPU).

``NativeDecodeStep`` hands every layer's block-quantized weights, norm
weights and KV cache to ``kernels/csrc/cpu_step.c`` once, at start-up; each
decode-only step is then the embedding lookup, one native call (all layers,
one OpenMP region with barriers between phases) and nothing else in Python.
It is the CPU counterpart of replaying a CUDA graph: the layer-by-layer
forward pays ~10 Python dispatches, ctypes crossings and OpenMP fork/joins per
layer, which for one stream of a 135M model cost more than the arithmetic.

The native step computes bit for bit what the layer-by-layer path computes
with the same strategies (BlockQuantLinear, NativeCpuModelOps, the cpu
attention backend): the same row functions in the same order
(tests/test_kernels.py and tests/test_engine.py check it), so switching it
off (``--cpu-decode-step per_layer``) changes speed, not tokens.

It applies to Llama-family models without per-head q/k norms, every linear a
``BlockQuantLinear`` in one block format, float32 activations and a float32
or float16 KV cache; anything else keeps the per-layer path (``build`` says
why). Prefill and mixed steps always take the per-layer path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.linear import BlockQuantLinear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kernels.cpu_native import CpuKernels, DecodeLayer, DecodeStepPlan
from kernels.kivi import KiviLayout


class NativeDecodeStep:
    """Runs decode-only steps of ``model`` natively over ``kv_caches``.

    ``max_rows``: the most sequences per step it takes (None: any), so that it
    stays equal to the per-layer path where that path changes kernels with
    the batch size (BlockQuantLinear's fp16 route on builds without VNNI).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: CpuKernels,
        plan: DecodeStepPlan,
        max_rows: int | None,
    ) -> None:
        self.model = model
        self.kernels = kernels
        self.plan = plan
        self.max_rows = max_rows

    @classmethod
    def build(
        cls,
        model: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_layout: KiviLayout | None = None,
    ) -> NativeDecodeStep:
        """The native step for ``model``, or ValueError saying why it cannot run it.
        ``kv_layout``: the caches are KIVI blocks of that layout (the step stores
        and reads them as the per-layer path does, bit for bit)."""
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"{type(model).__name__} is not a Llama-family model")
        cfg = model.config
        if cfg.qk_norm:
            raise ValueError("per-head q/k norms (Qwen3) are not in the native step")
        layers: list[DecodeLayer] = []
        linears: list[BlockQuantLinear] = []
        for layer, (kc, vc) in zip(model.model.layers, kv_caches, strict=True):
            assert isinstance(layer, LlamaDecoderLayer)
            if type(layer) is not LlamaDecoderLayer or not isinstance(layer.mlp, LlamaMLP):
                raise ValueError("Mixture-of-Experts layers are not in the native step")
            if kv_layout is None and (
                kc.dtype not in (torch.float32, torch.float16) or kc.dim() != 4
            ):
                raise ValueError("the native step reads float32/float16 or KIVI KV caches only")
            attn, mlp = layer.self_attn, layer.mlp
            if attn.key_basis is not None:
                raise ValueError("low-rank keys (--kv-low-rank-keys) are not in the native step")
            parts = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if not all(isinstance(p, BlockQuantLinear) for p in parts):
                raise ValueError("the linears are not block-quantized (--cpu-linear q4_1/q8_0)")
            qkv, o, gate_up, down = (p for p in parts if isinstance(p, BlockQuantLinear))
            linears += [qkv, o, gate_up, down]
            if gate_up.bias_f32 is not None or down.bias_f32 is not None:
                raise ValueError("MLP biases are not in the native step")
            layers.append(
                DecodeLayer(
                    attn_norm=layer.input_layernorm.weight.detach(),
                    ffn_norm=layer.post_attention_layernorm.weight.detach(),
                    qkv=qkv.qweight,
                    qkv_bias=qkv.bias_f32,
                    o=o.qweight,
                    o_bias=o.bias_f32,
                    gate_up=gate_up.qweight,
                    down=down.qweight,
                    k_cache=kc,
                    v_cache=vc,
                )
            )
        limits = {lin.max_native_rows for lin in linears}
        if len(limits) != 1:
            raise ValueError("the linears disagree on their native row limit")
        first = linears[0]
        plan = first.kernels.decode_step_plan(
            layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            cos_sin=model.model.rotary_emb.cos_sin_cache,
            final_norm=model.model.norm.weight.detach(),
            kv_layout=kv_layout,
        )
        return cls(model, first.kernels, plan, limits.pop())

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Final-normed hidden states ``[M, H]`` of a decode-only step, or None
        (the step has a prefill chunk, or more rows than ``max_rows``)."""
        m = input_ids.shape[0]
        if meta.num_decodes != len(meta.query_lens_cpu) or m == 0:
            return None
        if self.max_rows is not None and m > self.max_rows:
            return None
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)
        return self.kernels.decode_step(
            self.plan,
            x,
            positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            max_position=meta.max_seq_len - 1,
            max_slot=int(meta.slot_mapping.max()),
            max_seq_len=meta.max_seq_len,
        )
