"""Tool calling for one chat request: validate ``tools``/``tool_choice``, plan, format calls.

``resolve_tool_calling`` decides, before anything is generated, what the chat
template is offered, which parser (``server/tool_parsers/``) reads the output
and which grammar, if any, forces the calls (``required`` or a named function,
through ``EngineClient.tool_call_spec``). The chat route then parses the
generated text with ``ToolPlan.parser``, streamed or not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from engine.client import EngineClient, ForcedToolChoice, JsonObject
from engine.sampling.params import StructuredOutputSpec
from server.config import ServerConfig
from server.errors import ApiError
from server.protocol import ChatCompletionRequest
from server.tool_parsers import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble,
    get_tool_parser,
    infer_tool_parser,
    validate_tool_calls,
)

logger = logging.getLogger("fuel_serve.server")


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template sees, how output is parsed.

    ``parser`` None: tools are not offered (``tool_choice: "none"``).
    ``structured``: a grammar forcing the call (``"required"`` or a named function).
    """

    tools: list[JsonObject]
    parser: ToolParser | None = None
    structured: StructuredOutputSpec | None = None
    parallel: bool = True


def _check_tool_parameters(i: int, function: JsonObject) -> None:
    """400 unless ``function.parameters`` is absent or a valid JSON Schema object.

    Checked for every ``tool_choice`` (as OpenAI does): a broken schema would
    otherwise only surface later, as unvalidatable arguments or a grammar error.
    """
    params = function.get("parameters")
    if params is None:
        return
    where = f"tools.{i}.function.parameters"
    name = function["name"]
    if not isinstance(params, dict):
        raise ApiError(400, f"tool {name!r}: parameters must be a JSON Schema object", param=where)
    cls = jsonschema.validators.validator_for(params)
    try:
        cls.check_schema(params)
    except jsonschema.exceptions.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "<root>"
        raise ApiError(
            400,
            f"tool {name!r}: parameters is not a valid JSON Schema (at {path}): {exc.message}",
            param=where,
        ) from None


def _check_tools(tools: Sequence[JsonObject]) -> None:
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, "only function tools are supported", param=f"tools.{i}.type")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, "each tool needs function.name", param=f"tools.{i}.function.name")
        _check_tool_parameters(i, function)


def resolve_tool_calling(
    engine: EngineClient, body: ChatCompletionRequest, config: ServerConfig
) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and plan tool use.

    ``auto`` needs ``--enable-auto-tool-choice`` (as in vLLM); the parser is
    ``--tool-call-parser`` or inferred from the chat template. ``required`` and a
    named function are enforced by a grammar (``EngineClient.tool_call_spec``).
    """
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice requires tools.", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise ApiError(400, "parallel_tool_calls requires tools.", param="parallel_tool_calls")
        return None
    _check_tools(body.tools)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan(tools=[])  # the model must not call tools: do not offer them
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise ApiError(400, f"unknown tool_choice {choice!r}", param="tool_choice")
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            param="tool_choice",
        )
    parser_name = config.tool_call_parser or infer_tool_parser(engine.tokenizer.chat_template)
    try:
        parser = get_tool_parser(parser_name, body.tools)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    parallel = body.parallel_tool_calls is not False
    plan = ToolPlan(tools=list(body.tools), parser=parser, parallel=parallel)
    if choice == "auto":
        return plan
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400,
            "response_format cannot be combined with a forced tool_choice",
            param="response_format",
        )
    # A string here can only be "required" (auto returned, unknown strings refused).
    forced: ForcedToolChoice = "required" if isinstance(choice, str) else choice
    # InvalidRequestError (a choice or schema the grammar cannot enforce) is a 400.
    plan.structured = engine.tool_call_spec(body.tools, forced, parser_name, parallel)
    return plan


def log_invalid_calls(calls: Sequence[ToolCall], tools: Sequence[JsonObject]) -> None:
    """Log calls whose arguments do not follow their function's schema.

    As OpenAI does, such calls are still returned: the client owns its tools and
    judges them. Forced calls are grammar-generated, so a warning there is a bug.
    """
    for problem in validate_tool_calls(calls, tools):
        logger.warning("tool call does not validate: %s", problem)


def log_invalid_streamed(deltas: list[ToolCallDelta], tools: Sequence[JsonObject]) -> None:
    """``log_invalid_calls`` for the call deltas one streamed choice sent."""
    log_invalid_calls(assemble([StreamDelta(tool_calls=deltas)]).tool_calls, tools)


def tool_call_json(call: ToolCall) -> JsonObject:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def tool_delta_json(delta: ToolCallDelta) -> JsonObject:
    out: JsonObject = {"index": delta.index}
    function: JsonObject = {"arguments": delta.arguments}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out
