"""``GET /v1/models``, ``GET /v1/models/{id}``, and vLLM's ``POST /tokenize`` / ``/detokenize``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.errors import ApiError, retry_after
from server.prompts import check_token_ids, render_chat, template_kwargs
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.state import State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    engine = state.engine
    if engine is None:
        raise ApiError(503, "The model is still loading.", headers=retry_after(5))
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": state.started_at,
                "owned_by": "fuel-serve",
                "root": engine.model_name,
                "parent": None,
                "max_model_len": engine.max_model_len,
                "fuel": dict(engine.execution_info),  # ours: the execution path
                # Ours (issue 17): under a KV policy (the default here, or a request's
                # kv_policy extension) prompt + max_tokens may exceed max_model_len.
                "kv_policy": {
                    "default": engine.execution_info.get("kv_policy", "full"),
                    "windowed_context": engine.execution_info.get("kv_policy", "full") != "full",
                    "request_extension": True,
                },
            }
            for name in state.served_names(engine)
        ],
    }


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    models = await list_models(state)
    for m in models["data"]:
        if m["id"] == model_id:
            return dict(m)
    raise ApiError(
        404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
    )


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    engine = state.ready_engine()
    state.check_model(engine, body.model)
    tok = engine.tokenizer
    if body.messages is not None:
        ids = await render_chat(
            engine,
            [m.to_template_dict() for m in body.messages],
            body.add_generation_prompt,
            template_kwargs(body.chat_template_kwargs),
            continue_final_message=body.continue_final_message,
        )
    else:
        assert body.prompt is not None  # the model validator guarantees one of them
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tok.encode(body.prompt, add_special_tokens=add_special))
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": [tok.token_to_text(i) for i in ids] if body.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    engine = state.ready_engine()
    state.check_model(engine, body.model)
    check_token_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
