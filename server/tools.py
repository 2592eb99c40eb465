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

from engine.client import EngineClient, ForcedToolChoice, JsonObject, ToolCallFormat
from engine.sampling.params import StructuredOutputSpec
from server.config import ServerConfig, ToolParserName
from server.errors import ApiError
from server.protocol import ChatCompletionRequest
from server.schema_limits import check_json_depth, check_schema_limits
from server.tool_parsers import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble,
    get_tool_parser,
    validate_tool_calls,
)

logger = logging.getLogger("fuel_serve.server")


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template sees, how output is parsed.

    ``parser`` None: tools are not offered (``tool_choice: "none"``).
    ``structured``: a grammar forcing the calls (``"required"`` or a named function);
    then ``forced`` is true and nothing but calls can be generated.
    ``single_call``: ``parallel_tool_calls: false``. A forced turn's grammar
    generates exactly one call; under ``auto`` no grammar applies (the model may
    answer in text), so only the first call the model wrote is returned.
    """

    tools: list[JsonObject]
    parser: ToolParser | None = None
    structured: StructuredOutputSpec | None = None
    forced: bool = False
    single_call: bool = False


# Which parser reads which format, and the format a parser's forced calls take
# when the chat template names none of its own.
_PARSER_OF_FORMAT: dict[ToolCallFormat, ToolParserName] = {
    "hermes": "hermes",
    "llama3_json": "llama3_json",
    "mistral": "mistral",
    "mistral_v11": "mistral",
}


def _tool_format(parser: ToolParserName, template_format: ToolCallFormat | None) -> ToolCallFormat:
    """The format forced calls are generated in: the template's when the parser reads it."""
    if template_format is not None and _PARSER_OF_FORMAT[template_format] == parser:
        return template_format
    return parser


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
    check_schema_limits(params, where)  # before anything recursive reads it
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
    check_json_depth(list(tools), "tools")
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

    The parser is ``--tool-call-parser`` or the one for the chat template's
    tool-call format (``ClientTokenizer.tool_call_format``); ``auto`` is on when
    a parser is known, unless ``--no-enable-auto-tool-choice``. ``required`` and
    a named function are enforced by a grammar (``EngineClient.tool_call_spec``):
    1..8 calls (exactly one for a named function or ``parallel_tool_calls:
    false``), then the end of the turn.
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
    template_format = engine.tokenizer.tool_call_format
    parser_name = config.tool_call_parser or (
        _PARSER_OF_FORMAT[template_format] if template_format is not None else None
    )
    if choice == "auto":
        _check_auto_enabled(config, parser_name)
    if parser_name is None:
        raise ApiError(
            400,
            "the model's chat template names no known tool-call format: "
            "start the server with --tool-call-parser",
            param="tools",
        )
    try:
        parser = get_tool_parser(parser_name, body.tools)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    plan = ToolPlan(
        tools=list(body.tools), parser=parser, single_call=body.parallel_tool_calls is False
    )
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
    plan.structured = engine.tool_call_spec(
        body.tools,
        forced,
        _tool_format(parser_name, template_format),
        body.parallel_tool_calls is not False,
    )
    plan.forced = True
    return plan


def _check_auto_enabled(config: ServerConfig, parser_name: ToolParserName | None) -> None:
    """``auto`` is on by default when the format is known; ``--no-enable-auto-tool-choice`` off."""
    if config.enable_auto_tool_choice is False:
        raise ApiError(
            400,
            '"auto" tool choice is disabled on this server (--no-enable-auto-tool-choice)',
            param="tool_choice",
        )
    if parser_name is None:
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set (the model's chat template names no known tool-call format)",
            param="tool_choice",
        )


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
