"""Server-side settings (everything that is not the engine's ``EngineConfig``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerConfig:
    """HTTP front door settings; names follow ``vllm serve`` flags.

    ``served_model_name``: names clients may send as ``model``; empty means the
    engine's own ``model_name``. The first name is the one responses report.
    ``chat_template``: template *text* (the CLI reads the file) or None for the model's.
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer KEY``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    api_key: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    log_prompts: bool = False
    enable_request_traces: bool = False
    enable_debug_endpoints: bool = False
    uvicorn_log_level: str = "info"
    log_json: bool = False
    retry_after_draining_s: float = 5.0


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_bytes(value: str | int) -> int:
    """Parse a byte count: ``1073741824``, ``1GiB``, ``512MiB``, ``2G``, ``1.5GB``.

    ``KiB/MiB/GiB/TiB`` (and bare ``K/M/G/T``) are powers of 1024; ``KB/MB/GB/TB``
    are powers of 1000, as the units say. Raises ``ValueError`` on anything else.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte count must be non-negative, got {value}")
        return value
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"cannot parse byte count {value!r} (try 1GiB, 512MiB, 1000000)")
    number, unit, binary = m.group(1), m.group(2).upper(), m.group(3)
    exponent = "KMGT".find(unit) + 1 if unit else 0
    # A bare "G" means GiB (as vLLM and most CLIs read it); "GB" means 10^9.
    explicit_decimal = bool(unit) and not binary and value.strip().upper().endswith("B")
    base = 1000 if explicit_decimal else 1024
    result = float(number) * base**exponent
    if result != int(result):
        raise ValueError(f"byte count {value!r} is not a whole number of bytes")
    return int(result)
