"""server.logging_setup: one JSON object per line, metadata only unless log_prompts."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from server.logging_setup import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


@pytest.mark.usefixtures("restore_root")
def test_json_lines_with_extras_and_no_prompt() -> None:
    buf = io.StringIO()
    configure_logging(json=True, level="info", stream=buf)
    log = logging.getLogger("fuel.test")
    log.info(
        "request %s finished",
        "r1",
        extra={"request_id": "r1", "num_prompt_tokens": 12, "prompt": "my secret", "user": "u"},
    )
    log.debug("hidden at info")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed", extra={"request_id": "r2"})
    out = lines(buf)
    assert len(out) == 2
    first = out[0]
    assert first["msg"] == "request r1 finished"
    assert first["level"] == "INFO" and first["logger"] == "fuel.test"
    assert first["request_id"] == "r1" and first["num_prompt_tokens"] == 12
    assert isinstance(first["ts"], str) and first["ts"].endswith("+00:00")
    assert "prompt" not in first and "user" not in first
    assert first["withheld"] == ["prompt", "user"]
    assert "my secret" not in buf.getvalue()
    assert "RuntimeError: boom" in str(out[1]["exc"])


@pytest.mark.usefixtures("restore_root")
def test_log_prompts_keeps_text_and_reconfigure_replaces_handler() -> None:
    configure_logging(json=True, level="INFO", stream=io.StringIO())
    buf = io.StringIO()
    configure_logging(json=True, level="INFO", log_prompts=True, stream=buf)
    logging.getLogger("fuel.test").info("done", extra={"prompt": "hello", "request_id": "r"})
    out = lines(buf)
    assert out[0]["prompt"] == "hello" and "withheld" not in out[0]
    ours = [h for h in logging.getLogger().handlers if h.get_name() == "fuel-serve"]
    assert len(ours) == 1


@pytest.mark.usefixtures("restore_root")
def test_text_mode_and_bad_level() -> None:
    buf = io.StringIO()
    configure_logging(json=False, level="WARNING", stream=buf)
    logging.getLogger("fuel.test").warning("careful", extra={"request_id": "r9"})
    text = buf.getvalue()
    assert "careful" in text and "request_id=r9" in text
    with pytest.raises(ValueError):
        configure_logging(json=True, level="loud")
