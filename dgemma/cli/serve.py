"""`dgemma serve`: an OpenAI-compatible HTTP server over the continuous-batching engine, with a live page at `/`
(docs/serving.md). Needs the `serve` extra: pip install 'dgemma[serve]'."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dgemma.cli.flags import UsageError, add_model_args, add_runtime_args, add_sampler_args, overrides
from dgemma.cli.loading import autoregressive, chat_template, device_of, load
from dgemma.cli.parallel import add_parallel_arg, run_ranked
from dgemma.data.tokenizer import TURN_END, build_test_tokenizer
from dgemma.io.threads import usable_cores
from dgemma.sampling.request_rules import MAX_CANVAS_PASSES
from dgemma.serving.api import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_REQUEST_STEPS
from dgemma.serving.grammar_steps import GRAMMAR_STEP_SECONDS
from dgemma.serving.prefix_cache import DEFAULT_BLOCK_SIZE

INSTALL_HINT = "dgemma serve needs the serve extra: pip install 'dgemma[serve]'"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                              description=__doc__)
    add_model_args(p)
    add_runtime_args(p, threads_help="on CPU the cores this process may use but one, which the HTTP loop "
                     "keeps; at least 1")
    add_sampler_args(p, seed_help=None)  # no server-wide seed: each request carries its own `seed`
    p.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, metavar="PORT",
                   help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--allowed-hosts", metavar="NAMES", type=_names, default=(),
                   help="comma-separated Host names answered besides localhost (`*`: any); without --api-key on a "
                        "loopback address only localhost, 127.x.x.x and [::1] are answered (DNS rebinding)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the directory or preset)")
    p.add_argument("--lora", action="append", default=[], type=_lora_pair, metavar="NAME=DIR",
                   help="also serve the LoRA adapter in DIR (an adapter of this base model) as model NAME, on the "
                        "same weights and in the same batches (repeatable; docs/serving.md)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes): clients may then "
                        "load adapters from directories on this machine while it serves")
    p.add_argument("--max-batch", type=int, default=16, metavar="N", help="requests denoised together (default 16)")
    p.add_argument("--max-context", type=int, default=2048, metavar="N",
                   help="KV-cache slots per request: prompt + whole canvases (default 2048)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for a slot before 429 (default 256)")
    p.add_argument("--prefix-cache", type=int, metavar="TOKENS",
                   help="prompt tokens of K/V kept across requests, so a shared system prompt or the earlier turns "
                        "of a chat are not prefilled again (default 4 x --max-context; 0: off)")
    p.add_argument("--prefix-block", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                   help=f"tokens per prefix-cache block; prompts are prefilled in blocks of this size when the cache "
                        f"is on (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--max-concurrency", type=int, default=256, metavar="N",
                   help="HTTP generation requests in flight before 429 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body, else 413 (default 1 MiB)")
    p.add_argument("--max-n", type=int, default=8, metavar="N", help="the largest `n` a request may ask (default 8)")
    p.add_argument("--limit-denoising-steps", type=int, default=MAX_CANVAS_PASSES, metavar="N",
                   help="the most model passes one canvas of a request may cost: its max_denoising_steps, "
                   f"times (1 + corrector_steps) for predictor-corrector (default {MAX_CANVAS_PASSES})")
    p.add_argument("--max-request-steps", type=int, default=DEFAULT_MAX_REQUEST_STEPS, metavar="N",
                   help="the most denoising steps one request may run: choices x canvases x steps per canvas "
                        f"(default {DEFAULT_MAX_REQUEST_STEPS})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help=f"seconds a request body may take to arrive, else 408 (default {DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--grammar-step-seconds", type=float, default=GRAMMAR_STEP_SECONDS, metavar="SECONDS",
                   help="seconds of grammar work (response_format, a forced tool_choice) one denoising step of a "
                        "request may take; past them it ends with finish_reason length "
                        f"(default {GRAMMAR_STEP_SECONDS:g})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                   help="seconds a request's line and headers may take to arrive, else 408 and the connection closes "
                        f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    add_parallel_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.parallel is not None:  # rank 0 serves, the other ranks replay its model calls (dgemma/serving/ranks.py)
        for flag, given in (("--lora", args.lora), ("--allow-runtime-lora", args.allow_runtime_lora),
                            ("--prefix-cache", args.prefix_cache)):
            if given:
                raise UsageError(f"{flag} is not supported with --parallel yet (docs/parallel.md)")
        args.prefix_cache = 0
        return run_ranked(args, serve_http)
    return serve_http(args)


def serve_http(args: argparse.Namespace) -> int:
    try:
        import dgemma.serving.app  # noqa: F401
    except ImportError as e:
        if e.name in ("fastapi", "uvicorn", "prometheus_client", "jinja2", "starlette"):
            print(INSTALL_HINT, file=sys.stderr)
            return 2
        raise
    from dgemma.serving.guards import check_api_key

    for name in ("max_batch", "max_context", "max_queue", "max_concurrency", "max_request_bytes", "max_n",
                 "limit_denoising_steps", "max_request_steps", "prefix_block"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefix_cache is None:
        args.prefix_cache = 4 * args.max_context
    if args.prefix_cache != 0 and args.prefix_cache < args.prefix_block:
        raise UsageError(f"--prefix-cache must be 0 (off) or at least one block of --prefix-block "
                         f"{args.prefix_block} tokens, got {args.prefix_cache}")
    for flag in ("body_timeout", "header_timeout", "grammar_step_seconds"):
        if not 0 < getattr(args, flag) < float("inf"):
            raise UsageError(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {getattr(args, flag)}")
    check_api_key(args.api_key)  # before the model loads: a key that protects nothing is refused at once
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    ar = autoregressive(args)  # an AR run is served for scoring only (docs/serving.md)
    if ar and args.lora:
        raise UsageError(f"--lora: {args.model} is an autoregressive run (objective 'ar'), served for scoring only, "
                         "with the base model")
    args.device = device_of(args.device)
    if args.threads is None and args.device == "cpu":  # a spinning torch thread on every core starves the HTTP loop
        args.threads = max(1, usable_cores() - 1)
    model, gcfg, tok = load(args)
    leader = None
    if getattr(args, "dist", None) is not None:
        from dgemma.serving.ranks import Leader, follow

        if not args.dist.is_main:
            follow(model)
            return 0
        model = leader = Leader(model)
    try:
        return _serve(args, model, gcfg, tok, ar)
    finally:
        if leader is not None:
            leader.stop()


def _serve(args: argparse.Namespace, model: Any, gcfg: Any, tok: Any, ar: bool) -> int:
    """The engine and the HTTP server over `model` until Ctrl-C."""
    from dgemma.serving.api import Limits
    from dgemma.serving.app import create_app, serve
    from dgemma.serving.engine import Engine
    from dgemma.serving.guards import allowed_hosts

    if tok is None:
        tok = _toy_tokenizer(args, model)
        gcfg = gcfg.stopping_at(tok.token_to_id(TURN_END))
    config = gcfg.replace(**overrides(args, gcfg))
    template = chat_template(args)
    name = args.model_name or (Path(args.model).resolve().name if args.model is not None else args.preset)
    adapters = _adapters(model, name, args.lora)
    engine = Engine(model, max_batch=args.max_batch, max_context=args.max_context, max_queue=args.max_queue,
                    impl=args.impl, force=args.force, prefix_cache=args.prefix_cache,
                    prefix_block=args.prefix_block, adapters=adapters,
                    grammar_step_seconds=args.grammar_step_seconds).start()
    try:
        limits = Limits(max_n=args.max_n, max_canvas_passes=args.limit_denoising_steps,
                        max_request_steps=args.max_request_steps)
        app = create_app(engine, tok, name, template=template, generation_config=config, api_key=args.api_key,
                         max_request_bytes=args.max_request_bytes, max_concurrency=args.max_concurrency,
                         limits=limits, body_timeout=args.body_timeout,
                         allowed_hosts=allowed_hosts(args.host, args.api_key, args.allowed_hosts),
                         allow_runtime_lora=args.allow_runtime_lora, autoregressive=ar)
        what = "; an autoregressive run: scoring (echo) only" if ar else ""
        announce = lambda url: print(f"dgemma serve: {name} at {url} (OpenAI API at {url}v1{what}; Ctrl-C stops)",
                                     flush=True)
        serve(app, args.host, args.port, announce=announce, header_timeout=args.header_timeout)
    except KeyboardInterrupt:  # uvicorn shut down on Ctrl-C and re-raised it
        pass
    finally:
        engine.close()
    return 0


def _lora_pair(text: str) -> tuple[str, str]:
    """--lora NAME=DIR as (NAME, DIR)."""
    name, eq, path = text.partition("=")
    if not eq or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"give NAME=DIR (the model name clients send, an adapter directory), got "
                                         f"{text!r}")
    return name.strip(), path.strip()


def _adapters(model: Any, served: str, pairs: list[tuple[str, str]]) -> Any:
    """The AdapterSet of the --lora adapters (None without any): names unique and other than the served model's,
    each directory an adapter of this base (AdapterError naming the file otherwise)."""
    if not pairs:
        return None
    from dgemma.weights.adapters import AdapterError, AdapterSet

    names = [n for n, _ in pairs]
    for n in names:
        if n == served:
            raise UsageError(f"--lora {n}=...: {n!r} is the served model's name (--model-name); give the adapter "
                             "another")
        if names.count(n) > 1:
            raise UsageError(f"--lora {n}=...: the name {n!r} is given {names.count(n)} times; each adapter needs "
                             "its own")
    for n, path in pairs:
        if not Path(path).is_dir():
            raise UsageError(f"--lora {n}={path}: not a directory (a LoRA adapter directory, as `dgemma finetune` "
                             "writes)")
    adapters = AdapterSet(model)
    for n, path in pairs:
        try:
            adapters.add(n, path)
        except AdapterError as e:
            raise UsageError(f"--lora {n}={path}: {e}") from None
    return adapters


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"give comma-separated host names (or *), got {text!r}")
    return names


def _toy_tokenizer(args: argparse.Namespace, model: Any) -> Any:
    """A model without a tokenizer: a preset with random weights gets dgemma's toy byte-level BPE (its ids fit any
    vocabulary of 512 or more); a checkpoint must bring its own."""
    vocab = model.config.vocab_size
    if args.preset is None or vocab < 512:
        raise UsageError("serve needs a tokenizer: pass --tokenizer PATH or put tokenizer.json in the model "
                         "directory" + (f" (the model's vocabulary has {vocab} ids)" if args.preset else ""))
    print("dgemma serve: no --tokenizer; using dgemma's toy tokenizer (build_test_tokenizer(512))", file=sys.stderr)
    return build_test_tokenizer(512)
