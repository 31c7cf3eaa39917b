"""Structured output measured (docs/sampling.md, "Structured output"): a held-out set of JSON Schemas of the kinds
agents send, each asked of `dgemma serve` through the real openai client with response_format json_schema (whole and
streamed, the same seed) and without it (the schema in the prompt only); tool sets forced with tool_choice "required"
and a named function; and, through the library, what the constraint costs: tokens per forward and tokens/s with and
without it, and the share of a step the grammar's masks take.

    python runs/structured_output.py --model runs/out/cpu-small/diffusion-s0    # the trained cpu-small: minutes
    python runs/structured_output.py --smoke                                 # a tiny random model, seconds

The schemas (`held_out_schemas`, seeded) mix flat objects of strings, integers, numbers and booleans, enums, arrays
with item limits, nested objects, optional fields and strings with formats (date, email); strings carry a maxLength
as agents' schemas usually bound free text. Writes OUT/structured_output.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from harness import Server  # the server process runs/bench_serve.py measures: `python -m dgemma serve --port 0`

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("date", "email")


def held_out_schemas(n: int, seed: int = 0) -> list[dict]:
    """`n` JSON Schemas, the same for a seed: each an object of 1 to 5 properties of the kinds agents send."""
    rng = random.Random(seed)
    words = ["name", "city", "status", "count", "price", "tags", "owner", "items", "created", "email", "level",
             "enabled", "score", "notes", "id", "unit", "title", "priority"]

    def leaf(depth: int) -> dict:
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object", "format"]
                          if depth < 2 else ["string", "integer", "boolean", "enum"])
        if kind == "string":
            return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
        if kind == "integer":
            return {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 10_000])}
        if kind == "number":
            return {"type": "number", "minimum": 0, "maximum": 1000}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["low", "medium", "high", "open", "closed", "red", "green"], rng.randint(2, 4))}
        if kind == "format":  # a date is bounded by its format; an email is given a bound as free text is
            f = rng.choice(FORMATS)
            return {"type": "string", "format": f, **({"maxLength": 32} if f == "email" else {})}
        if kind == "array":
            return {"type": "array", "items": leaf(depth + 1), "minItems": 1, "maxItems": rng.choice([2, 3])}
        return obj(depth + 1)

    def obj(depth: int) -> dict:
        keys = rng.sample(words, rng.randint(1, 4 if depth else 5))
        props = {k: leaf(depth) for k in keys}
        required = [k for k in keys if rng.random() < 0.8] or keys[:1]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return [obj(0) for _ in range(n)]


def tool_sets(n: int, seed: int = 1) -> list[list[dict]]:
    """`n` lists of 1 to 3 functions whose parameters are held-out schemas."""
    rng = random.Random(seed)
    schemas = held_out_schemas(3 * n, seed)
    return [[{"type": "function", "function": {"name": f"tool_{i}_{k}", "parameters": schemas[3 * i + k]}}
             for k in range(rng.randint(1, 3))] for i in range(n)]


def validates(text: str | None, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), schema, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def served(args: argparse.Namespace, schemas: list[dict], tools: list[list[dict]]) -> dict:
    from openai import OpenAI

    # The model's tokenizer beside a chat template that writes Gemma 4's tool calls (examples/gemma4_tools.jinja),
    # so that tool_choice has a syntax to force whatever template the checkpoint has.
    from dgemma.weights.checkpoint import resolve_model_dir

    chat = args.out / "chat"
    chat.mkdir(parents=True, exist_ok=True)
    (chat / "tokenizer.json").write_bytes(Path(args.tokenizer or resolve_model_dir(args.model) / "tokenizer.json")
                                          .read_bytes())
    (chat / "chat_template.jinja").write_text((ROOT / "examples" / "gemma4_tools.jinja").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<bos>"}}))
    # --smoke's test tokenizer spells the tool template's prompt in ~1,900 tokens: the tiny model's whole context
    server = Server(model=args.model, max_batch=8, threads=args.threads, tokenizer=str(chat / "tokenizer.json"),
                    max_context=args.max_context)
    try:
        client = OpenAI(base_url=server.wait_ready() + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rows = []
        for i, schema in enumerate(schemas):
            ask = [{"role": "user", "content": "Reply with one JSON object valid against this JSON Schema: "
                                               + json.dumps(schema)}]
            common = dict(model=model, messages=ask, max_tokens=args.max_tokens, seed=i,
                          extra_body={"max_denoising_steps": args.steps})
            fmt = {"type": "json_schema", "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True}}
            t = time.perf_counter()
            whole = client.chat.completions.create(response_format=fmt, **common).choices[0]
            seconds = time.perf_counter() - t
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                response_format=fmt, stream=True, **common) if c.choices)
            plain = client.chat.completions.create(**common).choices[0]
            rows.append({"schema": i, "valid": validates(whole.message.content, schema),
                         "finish_reason": whole.finish_reason, "stream_valid": validates(streamed, schema),
                         "stream_same": streamed == whole.message.content, "seconds": seconds,
                         "unconstrained_valid": validates(plain.message.content, schema)})
        calls = []
        for i, fns in enumerate(tools):
            params = {f["function"]["name"]: f["function"]["parameters"] for f in fns}
            for choice in ("required", {"type": "function", "function": {"name": fns[-1]["function"]["name"]}}):
                for stream in (False, True):
                    common = dict(model=model, messages=[{"role": "user", "content": "Use a tool."}], tools=fns,
                                  tool_choice=choice, max_tokens=args.max_tokens, seed=i,
                                  extra_body={"max_denoising_steps": args.steps})
                    if stream:
                        made: dict[int, dict] = {}
                        for c in client.chat.completions.create(stream=True, **common):
                            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                                call = made.setdefault(d.index, {"name": "", "arguments": ""})
                                call["name"] += d.function.name or ""
                                call["arguments"] += d.function.arguments or ""
                        got = list(made.values())
                    else:
                        msg = client.chat.completions.create(**common).choices[0].message
                        got = [{"name": c.function.name, "arguments": c.function.arguments}
                               for c in msg.tool_calls or []]
                    ok = bool(got) and all(c["name"] in params and validates(c["arguments"], params[c["name"]])
                                           for c in got)
                    if not isinstance(choice, str):
                        ok = ok and [c["name"] for c in got] == [choice["function"]["name"]]
                    calls.append({"tools": i, "choice": "required" if choice == "required" else "named",
                                  "stream": stream, "ok": ok, "calls": len(got)})
        return {"schemas": rows, "tool_calls": calls}
    finally:
        server.stop()


def cost(args: argparse.Namespace, schemas: list[dict]) -> dict:
    """Tokens per forward, tokens/s and the grammar's share of the time, library calls alternating with and without
    the constraint on the same prompts and seeds (batch 1)."""
    import torch

    from dgemma import generate
    from dgemma.data.tokenizer import load_tokenizer
    from dgemma.sampling.constraint import Constraint
    from dgemma.weights.checkpoint import resolve_model_dir
    from dgemma.weights.loading import load_generation_config, load_model

    model, settings = load_model(args.model), load_generation_config(args.model)
    tok = load_tokenizer(args.tokenizer or resolve_model_dir(args.model) / "tokenizer.json")
    eos = settings.eos_token_id
    prompt = torch.tensor([tok.encode("Reply with JSON.")])
    runs = {"with": [], "without": []}
    for i, schema in enumerate(schemas[:args.cost_schemas]):
        c = Constraint.json_schema(schema, tok, eos_token_id=eos)
        for name in ("without", "with"):
            t = time.perf_counter()
            out = generate(model, prompt, generation_config=settings, seed=i, max_new_tokens=args.max_tokens,
                           max_denoising_steps=args.steps,
                           constraint=c if name == "with" else None, loop="readable")
            seconds = time.perf_counter() - t
            new = len(out.new_tokens()[0])
            runs[name].append({"tokens": new, "seconds": seconds,
                               "tokens_per_forward": float(out.tokens_per_forward[0]),
                               "grammar_seconds": out.constraint_seconds or 0.0,
                               "pinned": out.constraint_pinned or 0, "closed": out.constraint_closed or 0,
                               "complete": bool(out.constraint_complete and out.constraint_complete[0]),
                               "steps": sum(s[0] for s in out.steps_per_canvas),
                               "canvases": len(out.steps_per_canvas)})
    out = {}
    for name, rs in runs.items():
        out[name] = {"tokens_per_forward": statistics.mean(r["tokens_per_forward"] for r in rs),
                     "tokens_per_second": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
                     "grammar_share": sum(r["grammar_seconds"] for r in rs) / sum(r["seconds"] for r in rs),
                     "grammar_ms_per_step": 1000 * sum(r["grammar_seconds"] for r in rs) / max(
                         sum(r["steps"] for r in rs), 1),
                     "steps_per_canvas": sum(r["steps"] for r in rs) / sum(r["canvases"] for r in rs),
                     # committed tokens the grammar pinned (one token allowed) and its budget's closer chose
                     "pinned_share": sum(r["pinned"] for r in rs) / max(sum(r["tokens"] for r in rs), 1),
                     "closed_share": sum(r["closed"] for r in rs) / max(sum(r["tokens"] for r in rs), 1),
                     "complete": sum(r["complete"] for r in rs) / len(rs)}
    # Every other sampler under the same constraint (its committed canvas projected onto the grammar)
    from dgemma.sampling.generation_config import SAMPLERS

    out["samplers"] = {}
    for sampler in SAMPLERS[1:]:
        valid, tpf = [], []
        for i, schema in enumerate(schemas[:args.cost_schemas]):
            c = Constraint.json_schema(schema, tok, eos_token_id=eos)
            got = generate(model, prompt, seed=i, max_new_tokens=args.max_tokens, max_denoising_steps=args.steps,
                           constraint=c, loop="readable", sampler=sampler)
            valid.append(validates(tok.decode(got.new_tokens()[0], skip_special_tokens=True), schema))
            tpf.append(float(got.tokens_per_forward[0]))
        out["samplers"][sampler] = {"valid": sum(valid) / len(valid), "tokens_per_forward": statistics.mean(tpf)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a run or checkpoint (default: the tiny preset with random weights)")
    ap.add_argument("--tokenizer", help="tokenizer.json for a model without one")
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--tool-sets", type=int, default=10)
    ap.add_argument("--cost-schemas", type=int, default=8, help="schemas of the cost comparison")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16, help="max_denoising_steps")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None, help="the server's --max-context (default: its own)")
    ap.add_argument("--out", type=Path, default=Path("runs/out/structured-output"))
    ap.add_argument("--smoke", action="store_true", help="3 schemas, 2 tool sets, a tiny random model: seconds")
    args = ap.parse_args(argv)
    if args.smoke:  # a tiny random checkpoint with the test tokenizer, written where the results go
        from dgemma.data.tokenizer import build_test_tokenizer
        from dgemma.sampling.generation_config import GenerationConfig
        from dgemma.weights.checkpoint import save_pretrained
        from dgemma.weights.loading import build_model

        model_dir = args.out / "tiny-model"
        model_dir.mkdir(parents=True, exist_ok=True)
        model = build_model("tiny")
        save_pretrained(model, model_dir,
                        generation_config=GenerationConfig.for_model(model.config).replace(eos_token_id=(1,)))
        build_test_tokenizer(512, model_dir / "tokenizer.json")
        args.model = str(model_dir)
        args.schemas, args.tool_sets, args.cost_schemas, args.max_tokens, args.steps = 3, 2, 2, 256, 4
        args.max_context = 4096
    if args.model is None:
        ap.error("give --model (a run or checkpoint with its tokenizer.json) or --smoke")
    schemas, tools = held_out_schemas(args.schemas), tool_sets(args.tool_sets)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "cost": cost(args, schemas)}
    result |= served(args, schemas, tools)
    from dgemma.io.fsio import write_text
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "structured_output.json", json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def report(r: dict) -> str:
    lines = ["| | tokens/forward | steps/canvas | tokens/s | grammar share of the time | grammar ms per step | "
             "pinned | closed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("without", "with"):
        c = r["cost"][name]
        grammar = (f"{c['grammar_share']:.1%} | {c['grammar_ms_per_step']:.2f} | {c['pinned_share']:.1%} | "
                   f"{c['closed_share']:.1%}") if name == "with" else "– | – | – | –"
        lines.append(f"| {name} the constraint | {c['tokens_per_forward']:.2f} | {c['steps_per_canvas']:.1f} | "
                     f"{c['tokens_per_second']:.1f} | {grammar} |")
    lines += ["", "Other samplers, the same schemas: " + "; ".join(
        f"{name} {v['valid']:.0%} valid at {v['tokens_per_forward']:.2f} tokens/forward"
        for name, v in r["cost"]["samplers"].items()) + "."]
    if "schemas" in r:
        rows, calls = r["schemas"], r["tool_calls"]
        share = lambda key: sum(x[key] for x in rows) / len(rows)
        lines += ["", f"{len(rows)} held-out schemas: valid with response_format json_schema {share('valid'):.0%} "
                      f"(streamed {share('stream_valid'):.0%}, streamed text identical {share('stream_same'):.0%}); "
                      f"without it {share('unconstrained_valid'):.0%}. Finish reasons: "
                  + ", ".join(f"{k} {sum(x['finish_reason'] == k for x in rows)}"
                              for k in sorted({x['finish_reason'] for x in rows})) + ".",
                  f"{len(calls)} forced tool calls ({len(calls) // 4} tool sets x required / named x whole / "
                  f"streamed): {sum(c['ok'] for c in calls) / len(calls):.0%} parse and validate."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
