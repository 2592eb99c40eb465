"""``fuel-serve`` / ``python -m server.cli``: flags as ``vllm serve`` names them.

Precedence: CLI flag > ``--config FILE.yaml`` > ``configs/default.yaml`` > dataclass
defaults. Every ``EngineConfig`` and ``ServerConfig`` field is reachable.
SIGTERM drains: ``/health`` turns 503, new requests get 503 + Retry-After,
in-flight requests finish (up to ``--shutdown-timeout`` s), then exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
import yaml

from engine.config import EngineConfig
from server.config import ServerConfig, parse_bytes

logger = logging.getLogger("fuel_serve.cli")

DEFAULTS_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}
_BYTE_FIELDS = {"kv_cache_memory", "max_body_bytes"}


def _bool_flag(parser: argparse._ActionsContainer, name: str, help_text: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser. Defaults are suppressed so only given flags override files."""
    p = argparse.ArgumentParser(
        prog="fuel-serve",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "model", nargs="?", help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)."
    )
    p.add_argument("--config", help="YAML file of settings (keys = flag names with underscores).")
    g = p.add_argument_group("server")
    g.add_argument("--host", help="Interface to bind (default 127.0.0.1).")
    g.add_argument("--port", type=int, help="Port to bind (default 8000).")
    g.add_argument(
        "--served-model-name", nargs="+", help="Model name(s) clients use; the first is reported."
    )
    g.add_argument(
        "--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health."
    )
    g.add_argument("--chat-template", help="Jinja chat template file overriding the model's.")
    g.add_argument(
        "--max-body-bytes", type=parse_bytes, help="Largest request body (default 8MiB)."
    )
    g.add_argument(
        "--shutdown-timeout", type=float, help="Seconds in-flight requests get on SIGTERM."
    )
    g.add_argument("--tool-call-parser", help="Tool-call parser name (e.g. hermes).")
    _bool_flag(
        g, "--enable-auto-tool-choice", "Let the model decide to call tools (tool_choice=auto)."
    )
    _bool_flag(g, "--log-prompts", "Log prompts and outputs (off: metadata only).")
    _bool_flag(g, "--enable-request-traces", "Record per-request traces.")
    _bool_flag(g, "--enable-debug-endpoints", "Expose GET /debug/engine (engine stats).")
    g.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level (default info).",
    )
    _bool_flag(g, "--log-json", "Log one JSON object per line.")
    e = p.add_argument_group("engine")
    e.add_argument("--tokenizer", help="Tokenizer directory (default: the model's).")
    e.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="Weights/activations dtype.",
    )
    e.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="KV cache element type (auto: the model's dtype). float16 halves the cache and, "
        "on the CPU, the bytes each decode step reads; fp8 is not supported.",
    )
    e.add_argument("--device", choices=["auto", "cpu", "cuda"], help="Device to run on.")
    e.add_argument("--seed", type=int, help="Global random seed.")
    e.add_argument("--max-model-len", type=int, help="Context window (default: the model's).")
    e.add_argument("--block-size", type=int, help="Tokens per KV cache block.")
    e.add_argument(
        "--kv-cache-memory", type=parse_bytes, help="KV cache bytes on CPU (e.g. 1GiB, 512MiB)."
    )
    e.add_argument(
        "--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use (CUDA)."
    )
    e.add_argument("--num-gpu-blocks-override", type=int, help="Force the number of KV blocks.")
    e.add_argument("--max-num-seqs", type=int, help="Most sequences in one batch.")
    e.add_argument("--max-num-batched-tokens", type=int, help="Most tokens in one step.")
    _bool_flag(e, "--enable-chunked-prefill", "Split long prefills across steps.")
    _bool_flag(e, "--enable-prefix-caching", "Reuse KV blocks of shared prompt prefixes.")
    e.add_argument("--scheduling-policy", choices=["fcfs", "priority"], help="Waiting-queue order.")
    e.add_argument("--max-waiting-requests", type=int, help="Queue length before 429s.")
    e.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton", "cpu"],
        help="Attention implementation: auto = triton on CUDA, cpu (native decode kernel and "
        "fused norm/RoPE/SiLU ops, built on first use) on the CPU, torch where that cannot "
        "be built.",
    )
    e.add_argument(
        "--enforce-eager", action="store_true", help="Disable graph capture / compilation."
    )
    e.add_argument("--num-threads", type=int, help="CPU threads for torch.")
    e.add_argument(
        "--cpu-linear",
        choices=["auto", "torch", "onednn", "int8", "q4_1"],
        help="CPU matmuls: oneDNN-prepacked fp32 weights (auto: when available), plain torch, "
        "int8 (dynamic int8 quantization: much faster, approximate; opt-in), or q4_1 "
        "(llama.cpp's Q4_1 blocks, Q8_0 logits, native kernels for steps of up to 8 rows, fp16 "
        "above: fastest for few streams, near-exact; a Q4_1 GGUF keeps its exact weights).",
    )
    _bool_flag(e, "--debug-invariants", "Check scheduler/KV invariants every step (slow).")
    e.add_argument("--max-logprobs", type=int, help="Largest logprobs/top_logprobs accepted.")
    e.add_argument(
        "--max-traces", type=int, help="Request traces kept in memory (--enable-request-traces)."
    )
    return p


def _load_yaml(path: Path) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"fuel-serve: {path} must hold a mapping of settings")
    # Accept flag spelling (api-key) as well as field spelling (api_key).
    normalized = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(normalized) - _ENGINE_FIELDS - _SERVER_FIELDS)
    if unknown:
        raise SystemExit(f"fuel-serve: unknown setting(s) in {path}: {', '.join(unknown)}")
    return normalized


def resolve_settings(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Merged settings dict (defaults file < --config file < flags), byte sizes parsed."""
    args = vars(build_parser().parse_args(argv))
    settings: dict[str, Any] = {}
    if DEFAULTS_PATH.exists():
        settings.update(_load_yaml(DEFAULTS_PATH))
    config_file = args.pop("config", None)
    if config_file is not None:
        settings.update(_load_yaml(Path(config_file)))
    settings.update(args)
    for key in _BYTE_FIELDS:
        if key in settings and settings[key] is not None:
            try:
                settings[key] = parse_bytes(settings[key])
            except ValueError as exc:
                raise SystemExit(f"fuel-serve: {key}: {exc}") from None
    return settings


def build_configs(settings: dict[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """Split merged settings into the two dataclasses; reads the chat template file."""
    engine_kw = {k: v for k, v in settings.items() if k in _ENGINE_FIELDS and k != "chat_template"}
    server_kw = {k: v for k, v in settings.items() if k in _SERVER_FIELDS}
    template_path = settings.get("chat_template")
    template_text: str | None = None
    if template_path:
        try:
            template_text = Path(template_path).read_text()
        except OSError as exc:
            raise SystemExit(
                f"fuel-serve: cannot read --chat-template {template_path}: {exc}"
            ) from None
    server_kw["chat_template"] = template_text
    names = server_kw.get("served_model_name")
    server_kw["served_model_name"] = [names] if isinstance(names, str) else list(names or [])
    engine_cfg = EngineConfig(**engine_kw, chat_template=template_text)
    return engine_cfg, ServerConfig(**server_kw)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT instead of dropping streams.

    First signal: mark the app draining (503s, /health 503) and keep serving until
    in-flight requests finish or ``shutdown_timeout`` passes, then stop. A second
    signal stops at once. The signal is not re-raised, so a drained exit is status 0.
    """

    def __init__(self, config: uvicorn.Config, front: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.front = front
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None:
            self.front.draining = True
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
            logger.info("signal %s: draining %d in-flight request(s)", sig, self.front.in_flight)
        else:
            self.should_exit = True
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.front.in_flight == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                logger.warning(
                    "shutdown timeout: %d request(s) still running", self.front.in_flight
                )
                self.should_exit = True
        return await super().on_tick(counter)


def main(argv: Sequence[str] | None = None) -> int:
    settings = resolve_settings(argv)
    engine_cfg, server_cfg = build_configs(settings)
    from server.logging_setup import configure_logging

    configure_logging(server_cfg.log_json, server_cfg.uvicorn_log_level, server_cfg.log_prompts)
    from engine.async_engine import AsyncEngine  # heavy import: after argument errors
    from server.app import build_app

    logger.info(
        "starting fuel-serve: model=%s dtype=%s device=%s on %s:%d",
        engine_cfg.model or "SmolLM2-135M-Instruct (default)",
        engine_cfg.dtype,
        engine_cfg.device,
        server_cfg.host,
        server_cfg.port,
    )
    app = build_app(None, server_cfg, engine_factory=lambda: AsyncEngine(engine_cfg))
    config = uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.uvicorn_log_level,
        log_config=None,  # keep our logging setup
        timeout_graceful_shutdown=max(1, int(server_cfg.shutdown_timeout)),
    )
    server = DrainingServer(config, app.state.fuel.front, server_cfg.shutdown_timeout)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
