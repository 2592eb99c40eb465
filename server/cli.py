"""``fuel-serve`` / ``python -m server.cli``: flags as ``vllm serve`` names them.

Precedence: CLI flag > ``--config FILE.yaml`` > ``configs/default.yaml`` > dataclass
defaults. Every ``EngineConfig`` and ``ServerConfig`` field is reachable.
SIGTERM drains: ``/health`` turns 503, new requests get 503 + Retry-After,
in-flight requests finish (up to ``--shutdown-timeout`` s), then exit 0.
``--data-parallel-size N`` (N > 1) runs N replicas behind vllm-router instead
(server/data_parallel.py).

A model that cannot be loaded (unsupported, missing or corrupt files, a KV
cache that does not fit) stops the server at once: exit status 1, and the
last line on stderr says why.
"""

from __future__ import annotations

import argparse
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
from engine.settings import FieldSpec, coerce, field_specs
from server.config import ServerConfig
from server.middleware import FrontDoorState

logger = logging.getLogger("fuel_serve.cli")

DEFAULTS_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
_ENGINE_SPECS = {s.name: s for s in field_specs(EngineConfig)}
_SERVER_SPECS = {s.name: s for s in field_specs(ServerConfig)}
_ALL_SPECS = {**_ENGINE_SPECS, **_SERVER_SPECS}


def _add_flag(group: argparse._ActionsContainer, spec: FieldSpec) -> None:
    """One flag, derived from the field's type (see engine/settings.py)."""
    help_text = spec.help
    if spec.base is bool and not spec.is_list:
        group.add_argument(
            spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction, help=help_text
        )
        return
    kwargs: dict[str, Any] = {"dest": spec.name, "help": help_text}
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    if spec.is_list:
        kwargs["nargs"] = "+"
    if spec.kind == "plain" and spec.base in (int, float) and not spec.is_list:
        kwargs["type"] = spec.base
    if spec.default is not None and spec.default != [] and help_text:
        kwargs["help"] = f"{help_text} (default: {_show(spec.default)})"
    group.add_argument(spec.flag, **kwargs)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


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
    p.add_argument(
        "--print-defaults",
        action="store_true",
        help="Print every setting with its default as YAML (configs/default.yaml) and exit.",
    )
    g = p.add_argument_group("server")
    for spec in _SERVER_SPECS.values():
        if spec.cli:
            _add_flag(g, spec)
    e = p.add_argument_group("engine")
    for spec in _ENGINE_SPECS.values():
        if spec.cli:
            _add_flag(e, spec)
    return p


def defaults_yaml() -> str:
    """``configs/default.yaml``: every setting, its default and its help, from the dataclasses."""
    lines = [
        "# Fuel Serve defaults, loaded by `fuel-serve` before --config FILE.yaml and CLI flags",
        "# (precedence: CLI flag > --config file > this file). Keys are the flag names with",
        "# underscores. Sizes accept byte counts or 1GiB / 512MiB style strings.",
        "# Generated from engine/config.py and server/config.py: `fuel-serve --print-defaults`.",
    ]
    for title, specs in (
        ("engine (engine/config.py EngineConfig)", _ENGINE_SPECS),
        ("server (server/config.py ServerConfig)", _SERVER_SPECS),
    ):
        lines += ["", f"# --- {title} ---"]
        for spec in specs.values():
            value = yaml.safe_dump(spec.default, default_flow_style=True).strip()
            value = value.removesuffix("\n...").strip()
            note = spec.help
            if spec.choices is not None:
                note = f"{' | '.join(spec.choices)}. {note}"
            lines.append(f"{spec.name}: {value}  # {note}" if note else f"{spec.name}: {value}")
    return "\n".join(lines) + "\n"


def _load_yaml(path: Path) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"fuel-serve: {path} must hold a mapping of settings")
    # Accept flag spelling (api-key) as well as field spelling (api_key).
    normalized = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(normalized) - set(_ALL_SPECS))
    if unknown:
        raise SystemExit(f"fuel-serve: unknown setting(s) in {path}: {', '.join(unknown)}")
    return normalized


def resolve_settings(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Merged settings dict (defaults file < --config file < flags), values typed."""
    args = vars(build_parser().parse_args(argv))
    if args.pop("print_defaults", False):
        sys.stdout.write(defaults_yaml())
        raise SystemExit(0)
    settings: dict[str, Any] = {}
    if DEFAULTS_PATH.exists():
        settings.update(_load_yaml(DEFAULTS_PATH))
    config_file = args.pop("config", None)
    if config_file is not None:
        settings.update(_load_yaml(Path(config_file)))
    settings.update(args)
    for key, value in list(settings.items()):
        try:
            settings[key] = coerce(_ALL_SPECS[key], value)
        except ValueError as exc:
            raise SystemExit(f"fuel-serve: {_ALL_SPECS[key].flag}: {exc}") from None
    return settings


def build_configs(settings: dict[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """Split merged settings into the two dataclasses (each validates itself)."""
    engine_kw = {k: v for k, v in settings.items() if k in _ENGINE_SPECS}
    server_kw = {k: v for k, v in settings.items() if k in _SERVER_SPECS}
    try:
        return EngineConfig(**engine_kw), ServerConfig(**server_kw)
    except ValueError as exc:
        raise SystemExit(f"fuel-serve: {exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT instead of dropping streams.

    First signal: mark the app draining (503s, /health 503) and keep serving until
    in-flight requests finish or ``shutdown_timeout`` passes, then stop. A second
    signal stops at once. The signal is not re-raised, so a drained exit is status 0.
    """

    def __init__(
        self, config: uvicorn.Config, front: FrontDoorState, shutdown_timeout: float
    ) -> None:
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
    args = list(sys.argv[1:] if argv is None else argv)
    settings = resolve_settings(args)
    engine_cfg, server_cfg = build_configs(settings)
    from server.logging_setup import configure_logging

    configure_logging(server_cfg.log_json, server_cfg.uvicorn_log_level, engine_cfg.log_prompts)
    if server_cfg.data_parallel_size > 1:
        from server.data_parallel import run_data_parallel

        return run_data_parallel(args, server_cfg, engine_cfg.num_threads)
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
    failures: list[str] = []

    def load_failed(reason: str) -> None:
        # A model that cannot load must not leave a server answering 503 forever:
        # stop at once; main() exits non-zero with the reason as one line.
        failures.append(reason)
        server.should_exit = True

    def engine_failed(reason: str) -> None:
        # A running engine that failed for good (a dead tensor-parallel worker): exit 1.
        fatal.append(reason)
        server.should_exit = True

    fatal: list[str] = []
    app = build_app(
        None,
        server_cfg,
        engine_factory=lambda: AsyncEngine(engine_cfg),
        on_load_failure=load_failed,
        on_fatal=engine_failed,
    )
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
    if failures:
        sys.stderr.write(f"fuel-serve: error: the model could not be loaded: {failures[0]}\n")
        return 1
    if fatal:
        sys.stderr.write(f"fuel-serve: error: the engine failed: {fatal[0]}\n")
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
