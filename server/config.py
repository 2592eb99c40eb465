"""Server-side settings (everything that is not the engine's ``EngineConfig``).

Declared like ``EngineConfig`` (see engine/settings.py): the CLI flags, the
defaults file and validation are derived from these fields. A setting lives
in exactly one of the two: the engine owns what it reads (chat template,
traces, prompt logging), the server what only the front door needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.settings import parse_bytes, setting, validate_fields

DEFAULT_MAX_BODY_BYTES = 8 << 20

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
# vllm-router's --policy choices for plain (not prefill/decode) routing; kv_aware
# needs KV events, which Fuel Serve does not publish yet.
RouterPolicy = Literal["cache_aware", "round_robin", "power_of_two", "consistent_hash", "random"]
# The shipped tool-call parsers (server/tool_parsers/), named as vLLM names them.
ToolParserName = Literal["hermes", "llama3_json", "mistral"]
# What a chat whose rendered messages exceed the context gets (server/context_compression.py).
ContextCompression = Literal["off", "auto"]

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerConfig", "parse_bytes"]


@dataclass
class ServerConfig:
    """HTTP front door settings; names follow ``vllm serve`` flags.

    ``served_model_name``: names clients may send as ``model``; empty means the
    engine's own ``model_name``. The first name is the one responses report.
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer KEY``.
    """

    host: str = setting("127.0.0.1", "Interface to bind.")
    port: int = setting(8000, "Port to bind.", minimum=0, maximum=65535)
    served_model_name: list[str] = setting(
        help="Model name(s) clients use; the first is reported (default: the model's).",
        default_factory=list,
    )
    api_key: str | None = setting(
        None, "Require 'Authorization: Bearer KEY' on every route but /health."
    )
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "Largest request body (e.g. 8MiB).", kind="bytes", minimum=1
    )
    shutdown_timeout: float = setting(
        30.0, "Seconds in-flight requests get on SIGTERM.", minimum=0.0
    )
    tool_call_parser: ToolParserName | None = setting(
        None, "Tool-call parser (default: the chat template's tool-call format)."
    )
    enable_auto_tool_choice: bool | None = setting(
        None,
        "Let the model decide to call tools (tool_choice=auto). Default: on when the chat "
        "template has a known tool-call format (or --tool-call-parser is given).",
    )
    context_compression: ContextCompression = setting(
        "off",
        "A chat whose messages (plus max_tokens) exceed the context: 'off' answers 400 "
        "context_length_exceeded; 'auto' drops whole earlier turns (never system messages "
        "or the newest turn) until it fits. A request's 'truncation' overrides it.",
    )
    context_compression_reserve: int = setting(
        256,
        "Tokens context compression leaves for the answer of a request without max_tokens.",
        minimum=1,
    )
    enable_debug_endpoints: bool = setting(False, "Expose GET /debug/engine (engine stats).")
    uvicorn_log_level: LogLevel = setting("info", "Log level.")
    log_json: bool = setting(False, "Log one JSON object per line.")
    retry_after_draining_s: float = setting(
        5.0, "Retry-After sent with 503s while draining.", minimum=0.0
    )
    # Data parallelism on one host (server/data_parallel.py): N replicas behind vllm-router.
    data_parallel_size: int = setting(
        1,
        "Replicas of this server to run on this host behind vllm-router, which takes "
        "--host:--port (1: serve directly, no router).",
        minimum=1,
        maximum=64,
    )
    data_parallel_ports: list[int] = setting(
        help="Replica ports with --data-parallel-size N (default: --port+1 ... --port+N).",
        default_factory=list,
    )
    router_policy: RouterPolicy = setting(
        "cache_aware", "vllm-router's routing policy in front of the replicas."
    )
    router_executable: str = setting(
        "vllm-router", "The router program (PyPI vllm-router==0.1.17) started in front."
    )
    router_metrics_port: int = setting(
        29000, "Port of the router's own Prometheus metrics (on --host).", minimum=1, maximum=65535
    )

    def __post_init__(self) -> None:
        validate_fields(self)
