"""Loading and unloading LoRA adapters while `dgemma serve` runs (`--allow-runtime-lora`; docs/serving.md, "Many LoRA
adapters on one base"): vLLM's two routes, `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and
`POST /v1/unload_lora_adapter` {"lora_name"}, behind the API key like every /v1 route. Off by default: a client that
may name a directory on the server's disk is a decision for whoever runs it. The engine does the work
(`Engine.load_adapter` / `unload_adapter`): an adapter joins from the next pass on, and is refused for unloading while
requests use it. Apart from app.py because it is one opt-in feature with its own trust decision: the routes exist
only when the flag asks for them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from dgemma.serving.api import parse_json
from dgemma.serving.engine import EngineError
from dgemma.serving.errors import APIError
from dgemma.serving.guards import read_body, require_json
from dgemma.weights.adapters import AdapterError, AdapterNameError

log = logging.getLogger("dgemma.serve")


def add_adapter_routes(app: FastAPI, state: Any) -> None:
    """The two routes on `app`, over the app's state (its engine, key, model name and body limits)."""

    async def body_of(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
        state.authorize(request)
        require_json(request)
        body = parse_json(await read_body(request, state.max_request_bytes, state.body_timeout))
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise APIError(f"{unknown[0]}: not a field of this route (it takes {', '.join(fields)})", param=unknown[0])
        for field in fields:
            value = body.get(field)
            if not isinstance(value, str) or not value.strip():
                raise APIError(f"{field}: must be a non-empty string, got {value!r}", param=field)
        return body

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> dict[str, Any]:
        body = await body_of(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        if name == state.model_name:
            raise APIError(f"lora_name: {name!r} is the served model's name; give the adapter another",
                           param="lora_name")
        try:  # off the event loop and the engine thread: a slow disk holds up only this request
            await run_in_threadpool(state.engine.load_adapter, name, path)
        except AdapterNameError as e:  # not a safe name (dgemma/weights/adapters.py: check_name), or taken
            raise APIError(f"lora_name: {e}", param="lora_name") from None
        except AdapterError as e:
            raise APIError(f"lora_path: {e}", param="lora_path") from None
        log.info("loaded LoRA adapter %r from %s", name, path)
        return {"object": "lora_adapter", "id": name, "parent": state.model_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> dict[str, Any]:
        name = (await body_of(request, ("lora_name",)))["lora_name"]
        try:
            state.engine.unload_adapter(name)
        except EngineError as e:
            raise APIError(str(e), param="lora_name", status=409 if "in use" in str(e) else 404,
                           code="adapter_in_use" if "in use" in str(e) else "model_not_found") from None
        log.info("unloaded LoRA adapter %r", name)
        return {"object": "lora_adapter", "id": name, "status": "unloaded"}
