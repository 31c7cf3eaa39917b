"""dgemma's default tool-call prompt, for a chat template with no tool-call syntax of its own (dgemma's built-in
Gemma template, or a checkpoint template that marks no tool-call span): the conversation is rewritten into messages
any template renders, in the JSON tool-call format (Hermes / Qwen style, docs/serving.md):

    system     the system message, then the tools as JSON (one function a line) and how to call them:
               <tool_call>{"name": NAME, "arguments": {...}}</tool_call>
    assistant  its content, then each of its tool_calls written in that format
    tool       a user turn: <tool_response>{"name": ..., "content": ...}</tool_response>

So `tools` work on any checkpoint: the output parser reads the calls back (templates.JSON_TOOL_CALL) and a forced
`tool_choice` is a grammar of the same format. Apart from templates.py because it rewrites messages, whatever
template then renders them."""

from __future__ import annotations

import json
from typing import Any

TOOL_INSTRUCTIONS = ("You may call one or more functions to answer. The functions, as JSON Schema, one a line:\n"
                     "{tools}\n"
                     "To call a function, write <tool_call>{{\"name\": NAME, \"arguments\": {{...}}}}</tool_call> "
                     "for each call; the results come back in <tool_response></tool_response>.")


def needs_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether the conversation has anything of tools to write: tools offered, a call made, or a tool's result."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def tool_prompt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                         ) -> list[dict[str, Any]]:
    """`messages` with the tools, the calls and the results written as text (the module's format): plain
    system / user / assistant messages of string content."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}{calls}"})
        elif role == "tool":
            result = {"name": m["name"], "content": content} if m.get("name") else {"content": content}
            out.append({"role": "user", "content": "<tool_response>" + json.dumps(result, ensure_ascii=False)
                        + "</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        text = TOOL_INSTRUCTIONS.format(tools=listed)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", {})
    if isinstance(args, str):  # the chat parser gives objects; another caller may give OpenAI's JSON text
        args = json.loads(args) if args.strip() else {}
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>"
