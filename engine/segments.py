"""Prompt segments: which span of a prompt's token ids came from which message.

A leaf module (no engine imports) so that ``engine.request`` and the KV
policies (engine/kv/policies/) can both name it without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SegmentKind = Literal["system", "user", "assistant", "tool", "document"]


@dataclass(frozen=True)
class Segment:
    """A span of the prompt's token ids, ``[start, end)``, that came from one
    message (``turn``: the message's index in the conversation)."""

    start: int
    end: int
    kind: SegmentKind
    turn: int
