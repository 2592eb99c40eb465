"""CLI and settings layering (fast: nothing is loaded or served)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.cli import DEFAULTS_PATH, build_configs, build_parser, defaults_yaml, resolve_settings
from server.config import ServerConfig, parse_bytes

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1GiB", 1 << 30),
        ("512MiB", 512 << 20),
        ("2G", 2 << 30),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
        (4096, 4096),
        ("8MiB", 8 << 20),
        ("64 KiB", 64 << 10),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "1XB", "-5", "1.5"])
def test_parse_bytes_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_defaults_file_matches_dataclasses() -> None:
    """configs/default.yaml states every field, with the dataclasses' defaults."""
    settings = resolve_settings([])
    engine_cfg, server_cfg = build_configs(settings)
    assert engine_cfg == EngineConfig()
    assert server_cfg == ServerConfig()
    names = {f.name for f in dataclasses.fields(EngineConfig)} | {
        f.name for f in dataclasses.fields(ServerConfig)
    }
    import yaml

    assert set(yaml.safe_load(DEFAULTS_PATH.read_text())) == names


def test_every_engine_field_reachable_from_flags() -> None:
    dests = {a.dest for a in build_parser()._actions}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert f.name in dests, f"{cls.__name__}.{f.name} has no flag"


def test_defaults_file_is_generated_from_the_dataclasses() -> None:
    """configs/default.yaml is exactly what ``fuel-serve --print-defaults`` writes."""
    assert DEFAULTS_PATH.read_text() == defaults_yaml(), (
        "configs/default.yaml is stale: regenerate it with `fuel-serve --print-defaults`"
    )


def test_no_setting_in_both_configs() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    assert engine.isdisjoint(server), engine & server


def test_literal_choices_are_flag_choices_and_validated() -> None:
    actions = {a.dest: a for a in build_parser()._actions}
    assert actions["kv_cache_dtype"].choices == [
        "auto",
        "float32",
        "float16",
        "bfloat16",
        "kivi4",
        "kivi2",
    ]
    assert actions["attention_backend"].choices == ["auto", "torch", "triton", "cpu"]
    with pytest.raises(ValueError, match="--attention-backend: 'cuda' is not one of"):
        EngineConfig(attention_backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--max-num-seqs: must be at least 1"):
        EngineConfig(max_num_seqs=0)


def test_bad_yaml_value_names_the_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: lots\n")
    with pytest.raises(SystemExit, match="--max-num-seqs"):
        resolve_settings(["--config", str(cfg)])
    cfg.write_text("dtype: float8\n")
    with pytest.raises(SystemExit, match="--dtype: 'float8' is not one of"):
        build_configs(resolve_settings(["--config", str(cfg)]))


def test_precedence_cli_over_file_over_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 8\nkv_cache_memory: 256MiB\napi-key: k1\n")
    s = resolve_settings(["--config", str(cfg), "--port", "9002"])
    engine_cfg, server_cfg = build_configs(s)
    assert server_cfg.port == 9002  # flag beats file
    assert engine_cfg.max_num_seqs == 8  # file beats defaults
    assert engine_cfg.kv_cache_memory == 256 << 20
    assert server_cfg.api_key == "k1"
    assert server_cfg.host == "127.0.0.1"  # default bind is loopback


def test_flags_map_to_configs(tmp_path: Path) -> None:
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages[0]['content'] }}")
    s = resolve_settings(
        [
            "m.gguf",
            "--served-model-name",
            "a",
            "b",
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--enable-chunked-prefill",
            "--enforce-eager",
            "--scheduling-policy",
            "fcfs",
            "--chat-template",
            str(tpl),
            "--max-model-len",
            "512",
            "--shutdown-timeout",
            "3",
            "--enable-debug-endpoints",
            "--dtype",
            "float32",
        ]
    )
    engine_cfg, server_cfg = build_configs(s)
    assert engine_cfg.model == "m.gguf" and engine_cfg.max_model_len == 512
    assert not engine_cfg.enable_prefix_caching and engine_cfg.enable_chunked_prefill
    assert engine_cfg.enforce_eager and engine_cfg.scheduling_policy == "fcfs"
    assert engine_cfg.chat_template == str(tpl)  # the engine reads it at start-up
    assert not hasattr(server_cfg, "chat_template")  # one owner per setting
    assert server_cfg.served_model_name == ["a", "b"]
    assert server_cfg.shutdown_timeout == 3.0 and server_cfg.enable_debug_endpoints


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prot: 1\n")
    with pytest.raises(SystemExit, match="prot"):
        resolve_settings(["--config", str(cfg)])


def test_help_documents_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for flag in [
        "--host",
        "--port",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--dtype",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--api-key",
        "--chat-template",
        "--seed",
        "--config",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--max-waiting-requests",
        "--scheduling-policy",
        "--attention-backend",
        "--enforce-eager",
        "--tool-call-parser",
        "--enable-auto-tool-choice",
        "--log-prompts",
        "--enable-request-traces",
        "--shutdown-timeout",
        "--uvicorn-log-level",
    ]:
        assert flag in out.stdout, flag
