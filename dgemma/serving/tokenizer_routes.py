"""The tokenizer's routes as vLLM serves them (docs/serving.md, "Tokenizer routes"): `POST /tokenize` (a `prompt`
string, or chat `messages` rendered with the server's template) -> {"count", "max_model_len", "tokens"
[, "token_strs"]}, `POST /detokenize` {"tokens"} -> {"prompt"}, and `GET /tokenizer_info` (the tokenizer's class,
its special tokens, the model's length and the chat template's source), which lm-eval's remote tokenizer
(`tokenizer_backend=remote`: lm_eval.utils.RemoteTokenizer) reads in place of downloading a tokenizer named after the
model. At the server's root, as vLLM's, behind the API key like every route of the API. Apart from app.py because they
are the tokenizer's, not the model's: nothing here runs the model."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from dgemma.data.templates import ChatTemplateError
from dgemma.data.tokenizer import encode_template
from dgemma.model.config import is_int
from dgemma.serving.api import _messages, _template_kwargs, parse_json
from dgemma.serving.errors import APIError, model_not_found, short
from dgemma.serving.formats import tools_of
from dgemma.serving.guards import read_body, require_json

PROMPT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "return_token_strs", "chat_template_kwargs", "tools")
DETOKENIZE_FIELDS = ("model", "tokens")
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # what transformers wraps a tokenizer.json in, as dgemma's Tokenizer does


def add_tokenizer_routes(app: FastAPI, state: Any) -> None:
    """The three routes on `app`, over the app's state (its tokenizer, template, model and body limits)."""

    async def body_of(request: Request) -> dict[str, Any]:
        state.authorize(request)
        require_json(request)
        return parse_json(await read_body(request, state.max_request_bytes, state.body_timeout))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(tokenize_body, state, body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        _fields(body, DETOKENIZE_FIELDS)
        _model(state, body)
        tokens, vocab = body.get("tokens"), state.engine.model.config.vocab_size
        if not isinstance(tokens, list) or not all(is_int(t) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise APIError(f"tokens: must be a list of token ids (ints in [0, {vocab})), got {short(tokens)}",
                           param="tokens")
        return {"prompt": state.tokenizer.decode(tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        state.authorize(request)
        return info(state)


def info(state: Any) -> dict[str, Any]:
    """/tokenizer_info: vLLM's shape (the tokenizer's class and its config's fields). `eos_token` is the first of the
    server's stop ids (`GenerationConfig.eos_token_id`), as text that /tokenize encodes back to that id; `chat_template`
    the checkpoint's Jinja source (null with dgemma's built-in Gemma template, which is code, not Jinja)."""
    tok, config = state.tokenizer, state.config
    special = tok.special_tokens()
    token = lambda i: None if i is None or i not in special else special[i]
    eos = next((t for i in config.eos_token_id if (t := token(i)) is not None), None)
    positions = state.engine.model.config.max_position_embeddings
    return {"tokenizer_class": TOKENIZER_CLASS, "eos_token": eos, "bos_token": token(tok.bos_id),
            "pad_token": token(config.pad_token_id), "model_max_length": positions, "max_model_len": positions,
            "vocab_size": tok.vocab_size, "chat_template": state.template.source}


def tokenize_body(state: Any, body: dict[str, Any]) -> dict[str, Any]:
    """/tokenize of a parsed body: `prompt` (encoded with the tokenizer's post-processor unless add_special_tokens is
    false; default true, as vLLM) or `messages` (rendered with the server's chat template, as /v1/chat/completions
    renders them; its control tokens written out, so add_special_tokens defaults to false)."""
    chat = "messages" in body
    if chat and "prompt" in body:
        raise APIError("give prompt or messages, not both", param="messages")
    _fields(body, CHAT_FIELDS if chat else PROMPT_FIELDS)
    _model(state, body)
    flags = {}
    for name, default in (("add_special_tokens", not chat), ("return_token_strs", False),
                          ("add_generation_prompt", True), ("continue_final_message", False)):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise APIError(f"{name}: must be true or false, got {short(v)}", param=name)
        flags[name] = default if v is None else v
    tok = state.tokenizer
    if chat:
        if flags["continue_final_message"]:
            raise APIError("continue_final_message: not supported (the template closes every message); send false",
                           param="continue_final_message")
        kwargs, _ = _template_kwargs(body, state.template)
        try:
            text = state.template.render(_messages(body.get("messages")), tools_of(body),
                                         add_generation_prompt=flags["add_generation_prompt"], kwargs=kwargs)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None
        ids = tok.encode(text, add_special_tokens=True) if flags["add_special_tokens"] else encode_template(tok, text)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(f"prompt: must be a string, got {short(prompt)}", param="prompt")
        ids = tok.encode(prompt, add_special_tokens=flags["add_special_tokens"])
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.model.config.max_position_embeddings,
                           "tokens": ids}
    if flags["return_token_strs"]:
        out["token_strs"] = [tok.backend.id_to_token(i) for i in ids]
    return out


def _fields(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise APIError(f"{unknown[0]}: not a field of this route (it takes {', '.join(fields)})", param=unknown[0])


def _model(state: Any, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model not in state.served():
        raise model_not_found(model if isinstance(model, str) else short(model), state.served())
