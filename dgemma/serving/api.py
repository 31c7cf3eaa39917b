"""OpenAI request rules of `dgemma serve`, as pure functions (no HTTP): a parsed JSON body becomes a
`GenerationRequest` (prompt token ids, one `Submission` per choice with its `GenerationConfig` and seed, the stream
options and stop strings), or an `APIError` that names the field. docs/serving.md lists every rule.

Every OpenAI field is used, mapped by a documented rule (`temperature` scales the sampler's temperature schedule),
or refused unless it has its neutral value; dgemma's sampler settings are extra top-level fields, those of
`GenerationConfig.request_settings` (OpenAI's sampling fields among them, each the setting of its name), validated by
`GenerationConfig.replace` exactly as `dgemma.generate`'s keywords are. Unknown fields are refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from dgemma.data.templates import ChatTemplate, ChatTemplateError, Convention
from dgemma.data.tokenizer import Tokenizer, encode_template
from dgemma.model.config import ConfigError, is_int, is_real
from dgemma.sampling.generation_config import MIN_TEMPERATURE, GenerationConfig, is_seed, offset_seed, seed_problem
from dgemma.sampling.request_rules import MAX_CANVAS_PASSES, canvas_count, canvas_passes_problem, request_passes
from dgemma.serving.choice import stop_strings
from dgemma.serving.errors import APIError, as_list, model_not_found, short
from dgemma.serving.formats import check_call_budget, response_constraint, tool_constraint, tools_of

# Fields newer SDKs and frameworks send that change nothing a model computes: accepted, checked for their type, and
# logged once per request as ignored (docs/serving.md)
IGNORED = ("store", "metadata", "service_tier")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
COMMON_FIELDS = ("model", "max_tokens", "stop", "seed", "n", "stream", "stream_options", "temperature", "top_p",
                 "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "user", *IGNORED)
# OpenAI chat fields dgemma has nothing for: accepted at their neutral value (null, or the one listed), else a 400
# saying what to send instead (docs/serving.md)
CHAT_NEUTRAL = {"functions": ((None,), "the deprecated functions API; send tools"),
                "function_call": ((None, "none", "auto"), "the deprecated functions API; send tool_choice"),
                "modalities": ((None, ["text"]), "text is the only output modality"),
                "prediction": ((None,), "predicted outputs"),
                "audio": ((None,), "audio output")}
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
               "response_format", "chat_template_kwargs", "reasoning_effort", *CHAT_NEUTRAL)
# echo: true with max_tokens 0 or 1 scores the prompt (its NELBO per token, docs/serving.md) and reads these two
SCORING_FIELDS = ("nelbo_steps", "nelbo_samples")
COMPLETION_FIELDS = ("prompt", "echo", "best_of", "suffix", "response_format", *SCORING_FIELDS)
DEFAULT_NELBO_STEPS = 16  # T of the scoring bound: training's default T (docs/training.md)
MAX_NELBO_STEPS = 4096
DEFAULT_NELBO_SAMPLES = 4  # t samples per canvas of the scoring bound
MAX_NELBO_SAMPLES = 64
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
MAX_CHOICES = 64  # engine requests one HTTP request may make (prompts x n)
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # the completions endpoint's logprobs, as OpenAI
MAX_JSON_DEPTH = 64  # objects and lists nested in a request body (a tool's JSON schema needs a dozen)
MAX_INT_DIGITS = 64  # digits of a JSON integer (a seed has at most 19; Python refuses to convert over 4,300)
DEFAULT_MAX_REQUEST_STEPS = 65536
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's line and headers to arrive (nginx: client_header_timeout)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Limits:
    """The work one request may ask of the server (`dgemma serve --max-n --limit-denoising-steps
    --max-request-steps`): `max_n` choices per prompt, `max_canvas_passes` model passes per canvas (the cap on a
    request's `max_denoising_steps`, corrector passes included), and `max_request_steps` denoising steps in all
    (choices x canvases x steps per canvas, the most the engine could run for it)."""

    max_n: int = 8
    max_canvas_passes: int = MAX_CANVAS_PASSES
    max_request_steps: int = DEFAULT_MAX_REQUEST_STEPS

    def __post_init__(self) -> None:
        for name in ("max_n", "max_canvas_passes", "max_request_steps"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    def check_steps(self, config: GenerationConfig) -> None:
        """Refuse a config whose model passes a canvas (its steps, corrector passes included) are over the per-canvas
        cap (a request's, or the server's default config at start), naming the field."""
        problem = canvas_passes_problem(config, self.max_canvas_passes, "on this server (--limit-denoising-steps)")
        if problem is not None:
            raise APIError(problem[1], param=problem[0])


@dataclass(frozen=True)
class Submission:
    """One engine request: choice `index` of prompt `prompt`."""

    index: int
    prompt: int
    config: GenerationConfig
    seed: int | None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request."""

    kind: str  # "chat" or "completion"
    prompts: list[list[int]]
    submissions: list[Submission]
    stream: bool
    include_usage: bool
    include_denoising: bool
    stop: tuple[str, ...]
    conventions: tuple[Convention, ...]  # how to split the output (chat with a template that marks spans)
    constraint: Any = None  # sampling.constraint.Constraint of response_format json_object / json_schema, or None
    # the request's own max_tokens field ("max_tokens" or "max_completion_tokens"), None where it gave none (the
    # server's default is then clamped to what fits beside the prompt)
    max_tokens_field: str | None = None
    ignored: tuple[str, ...] = ()  # fields given that change nothing here (IGNORED, an unread reasoning_effort)
    opened: Convention | None = None  # the thinking span the prompt leaves open: the output begins inside it
    logprobs: int | None = None  # None: no logprobs; k: each token's log-probability and k alternatives
    scoring: Scoring | None = None  # echo + max_tokens 0 or 1: score the prompts (and append a greedy next token)
    calls_only: bool = False  # a forced tool_choice: the output is its tool calls, never their markup as content


@dataclass(frozen=True)
class Scoring:
    """What an echo + max_tokens 0 or 1 request asks: each prompt's score per token (a diffusion model's NELBO terms,
    `likelihood.score_continuation` with an empty context, at T = `num_steps` (None: the continuous-time bound),
    `num_t_samples` stratified t per canvas, Monte Carlo seed `seed`; an autoregressive model's exact log-probs), and
    with `next_token` (max_tokens 1) the model's greedy next token after it (dgemma/serving/scoring.py)."""

    num_steps: int | None
    num_t_samples: int
    seed: int
    next_token: bool = False


class _Refused:
    """A JSON number `load_json` does not accept, kept in place so that the error names where it is."""

    def __init__(self, problem: str):
        self.problem = problem


def _parse_int(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits:,} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _parse_float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"the number {text[:24]} overflows a float (not finite)")


def _parse_constant(text: str) -> _Refused:
    return _Refused(f"{text} is not a JSON number (non-finite numbers are refused)")


def load_json(text: bytes | str, *, what: str = "the request body", param: str | None = None) -> Any:
    """JSON from a client, or a 400 naming where it is wrong. The one parser of untrusted JSON (request bodies,
    tool-call arguments): beyond the syntax it refuses nesting deeper than MAX_JSON_DEPTH, integers over
    MAX_INT_DIGITS digits, numbers that are not finite (NaN, Infinity, 1e999) and strings with lone surrogates
    (not valid Unicode: no tokenizer or encoder takes them). The error's `param` is `param`, else the top-level
    key of a body where the problem is."""
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise APIError(f"{what}: nests deeper than {MAX_JSON_DEPTH} levels", param=param) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"{what} is not valid JSON: {e}", param=param) from None
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:  # iterative, so that the check itself cannot recurse too deep
        v, path = stack.pop()
        problem = None
        if isinstance(v, _Refused):
            problem = v.problem
        elif isinstance(v, str) and (m := _SURROGATE.search(v)):
            problem = f"a lone surrogate (U+{ord(m.group()):04X}) is not valid Unicode text"
        elif isinstance(v, (dict, list)) and len(path) >= MAX_JSON_DEPTH:
            problem = f"nests deeper than {MAX_JSON_DEPTH} levels"
        elif isinstance(v, dict):
            for k, item in v.items():
                if m := _SURROGATE.search(k):
                    problem = f"a key with a lone surrogate (U+{ord(m.group()):04X}) is not valid Unicode text"
                    break
                stack.append((item, (*path, k)))
        elif isinstance(v, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(v))
        if problem is not None:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
            top = param or (path[0] if path and isinstance(path[0], str) and path[0].isidentifier() else None)
            raise APIError(f"{what}{', at ' + where if where else ''}: {problem}", param=top)
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (`load_json`'s rules), or a 400."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_chat_request(body: dict[str, Any], *, tokenizer: Tokenizer, template: ChatTemplate,
                       base_config: GenerationConfig, model_name: str, limits: Limits = Limits(),
                       canvas_length: int | None = None) -> GenerationRequest:
    """POST /v1/chat/completions: messages rendered with `template`. `limits` caps the work asked; the total
    (`max_request_steps`) is checked when `canvas_length` (the model's) is given."""
    _check_fields(body, COMMON_FIELDS + CHAT_FIELDS + base_config.request_settings())
    for name, (neutral, what) in CHAT_NEUTRAL.items():
        _neutral(body, name, neutral, what)
    tools = tools_of(body)
    forced = tool_constraint(body, tools, template, tokenizer, base_config)
    # parallel_tool_calls=false is kept only where the grammar keeps it (a forced call)
    if not forced:
        _neutral(body, "parallel_tool_calls", (None, True))
    logprobs = _chat_logprobs(body)
    constraint = response_constraint(body.get("response_format"), tokenizer, base_config)
    if constraint is not None and forced is not None:
        raise APIError("give response_format or a forced tool_choice, not both (the output is one or the other)",
                       param="tool_choice")
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] is not None \
            and body["max_completion_tokens"] is not None:
        raise APIError("give one of max_tokens and max_completion_tokens, not both", param="max_completion_tokens")
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    messages = _messages(body.get("messages"))
    kwargs, ignored = _template_kwargs(body, template)
    try:
        text = template.render(messages, tools, kwargs=kwargs)
    except ChatTemplateError as e:
        param = "chat_template_kwargs" if "template kwargs" in str(e) else \
            "tools" if tools and template.builtin else "messages"
        raise APIError(str(e), param=param) from None
    prompt = encode_template(tokenizer, text)
    if not prompt:
        raise APIError("messages: the chat template rendered an empty prompt", param="messages")
    conventions = template.conventions
    if body.get("tool_choice") == "none" or (not tools and template.tool_prompt):  # no calls asked for
        conventions = tuple(c for c in conventions if c.kind != "tool")
    if constraint is not None:  # the output is the JSON itself: no thinking or tool-call spans to split out
        conventions = ()
    constraint = constraint or forced  # a forced call: the tool-call spans are the output, parsed as always
    opened = template.opened(text) if conventions and constraint is None else None
    request = _request("chat", body, [prompt], base_config, model_name, limits, canvas_length, max_tokens_field,
                       conventions)
    if forced is not None:
        check_call_budget(forced, request.submissions[0].config.max_new_tokens, max_tokens_field,
                          given=request.max_tokens_field is not None)
    return dataclasses.replace(request, constraint=constraint, opened=opened, ignored=request.ignored + ignored,
                               logprobs=logprobs, calls_only=forced is not None)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (true/false) and `top_logprobs` (0 to MAX_TOP_LOGPROBS, with logprobs true) as the number of
    alternatives per token, None for none."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(f"logprobs: must be true or false, got {json.dumps(on)}", param="logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise APIError(f"top_logprobs: must be an int from 0 to {MAX_TOP_LOGPROBS}, got {json.dumps(top)}",
                       param="top_logprobs")
    if top and not on:
        raise APIError("top_logprobs: needs logprobs: true", param="top_logprobs")
    return (top or 0) if on else None


def _template_kwargs(body: dict[str, Any], template: ChatTemplate) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The variables a chat request gives its template: `chat_template_kwargs` (an object: enable_thinking, ...)
    and `reasoning_effort` where the template reads it (as vLLM passes it), and the fields that change nothing."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError(f"chat_template_kwargs: must be an object, got {json.dumps(kwargs)}",
                       param="chat_template_kwargs")
    kwargs = dict(kwargs or {})
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs, ()
    if effort not in REASONING_EFFORTS:
        raise APIError(f"reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)}",
                       param="reasoning_effort")
    if "reasoning_effort" not in template.variables:
        return kwargs, ("reasoning_effort",)
    return {"reasoning_effort": effort, **kwargs}, ()


def parse_completion_request(body: dict[str, Any], *, tokenizer: Tokenizer, base_config: GenerationConfig,
                             model_name: str, limits: Limits = Limits(), canvas_length: int | None = None
                             ) -> GenerationRequest:
    """POST /v1/completions: a prompt string, strings, token ids or token-id lists (`limits` as for chat)."""
    _check_fields(body, COMMON_FIELDS + COMPLETION_FIELDS + base_config.request_settings())
    for name, neutral in (("best_of", (None, 1)), ("suffix", (None, ""))):
        _neutral(body, name, neutral)
    scoring = _scoring(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise APIError(f"logprobs: must be an int from 0 to {MAX_COMPLETION_LOGPROBS} (the alternatives per token), "
                       f"got {json.dumps(logprobs)}", param="logprobs")
    prompts = _prompts(body.get("prompt"), tokenizer)
    constraint = response_constraint(body.get("response_format"), tokenizer, base_config)  # as chat's (vLLM's)
    if scoring is not None:  # nothing is generated: the generation fields are checked, max_tokens is not a budget
        if constraint is not None:
            raise APIError("response_format: scoring (echo with max_tokens 0 or 1) has no output to constrain",
                           param="response_format")
        body = {k: v for k, v in body.items() if k != "max_tokens"}
        canvas_length = None
    return dataclasses.replace(_request("completion", body, prompts, base_config, model_name, limits, canvas_length,
                                        "max_tokens", ()), logprobs=logprobs, scoring=scoring, constraint=constraint)


def _scoring(body: dict[str, Any]) -> Scoring | None:
    """`echo`'s rule: true with max_tokens 0 scores the prompt, true with max_tokens 1 scores it and appends the
    model's greedy next token (lm-eval's loglikelihood request; docs/serving.md "Scoring a prompt"): one response,
    n 1, one seed for every prompt; true with anything else is refused (echoing the prompt before generated text is
    not supported); the scoring fields only with it."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise APIError(f"echo: must be true or false, got {json.dumps(echo)}", param="echo")
    if not echo:
        for name in SCORING_FIELDS:
            if body.get(name) is not None:
                raise APIError(f"{name}: only with echo: true and max_tokens 0 or 1 (scoring the prompt)", param=name)
        return None
    max_tokens = body.get("max_tokens")
    if not (is_int(max_tokens) and not isinstance(max_tokens, bool) and max_tokens in (0, 1)):
        raise APIError("echo: true is supported only with max_tokens 0 (score the prompt) or 1 (score it and append "
                       "the model's greedy next token, as lm-eval's loglikelihood requests ask; docs/serving.md); "
                       "echoing the prompt before longer generated text is not, got max_tokens "
                       f"{json.dumps(max_tokens)}", param="echo")
    if body.get("stream"):
        raise APIError("stream: scoring (echo with max_tokens 0 or 1) answers in one JSON response; send stream: false",
                       param="stream")
    if body.get("n") not in (None, 1):
        raise APIError(f"n: scoring (echo with max_tokens 0 or 1) has one result per prompt; n must be 1, got "
                       f"{json.dumps(body.get('n'))}", param="n")
    steps = body.get("nelbo_steps")
    if steps is None:
        steps = DEFAULT_NELBO_STEPS
    elif steps == "continuous":
        steps = None
    elif not (is_int(steps) and not isinstance(steps, bool) and 1 <= steps <= MAX_NELBO_STEPS):
        raise APIError(f"nelbo_steps: must be an int from 1 to {MAX_NELBO_STEPS} (T of the discrete bound) or "
                       f'"continuous", got {json.dumps(steps)}', param="nelbo_steps")
    samples = body.get("nelbo_samples", DEFAULT_NELBO_SAMPLES)
    most = MAX_NELBO_SAMPLES if steps is None else min(MAX_NELBO_SAMPLES, steps)
    if not (is_int(samples) and not isinstance(samples, bool) and 1 <= samples <= most):
        raise APIError(f"nelbo_samples: must be an int from 1 to {most} (t samples per canvas"
                       f"{'' if steps is None else ', at most nelbo_steps'}), got {json.dumps(samples)}",
                       param="nelbo_samples")
    seed = body.get("seed")
    # a bad seed: refused by `_request`
    return Scoring(steps, samples, seed if is_seed(seed) else 0, next_token=max_tokens == 1)


def _request(kind: str, body: dict[str, Any], prompts: list[list[int]], base: GenerationConfig, model_name: str,
             limits: Limits, canvas_length: int | None, max_tokens_field: str, conventions: tuple[Convention, ...]
             ) -> GenerationRequest:
    model = body.get("model")
    if model is not None and model != model_name:
        raise model_not_found(model, (model_name,))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(f"user: must be a string, got {body['user']!r}", param="user")
    ignored = _ignored(body)
    if body.get("logit_bias") is not None and not isinstance(body["logit_bias"], dict):
        raise APIError(f"logit_bias: must be an object of token id -> bias, got {json.dumps(body['logit_bias'])}",
                       param="logit_bias")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not is_int(n) or not 1 <= n <= limits.max_n:
        raise APIError(f"n: must be an int from 1 to {limits.max_n}, got {n!r}", param="n")
    choices = len(prompts) * n
    if choices > MAX_CHOICES:
        raise APIError(f"{len(prompts)} prompts x n={n} make {choices} choices; at most {MAX_CHOICES}", param="n")
    seed = body.get("seed")
    problem = None if seed is None else seed_problem(seed)
    if problem is not None:
        raise APIError(f"seed: {problem}", param="seed")
    stream = body.get("stream", False)
    if stream not in (None, True, False):
        raise APIError(f"stream: must be true or false, got {stream!r}", param="stream")
    include_usage, include_denoising = _stream_options(body.get("stream_options"), bool(stream))
    config = _config(body, base, max_tokens_field)
    limits.check_steps(config)
    if canvas_length is not None:
        work = request_passes(config, canvas_length, choices)
        if work > limits.max_request_steps:
            canvases = canvas_count(config.max_new_tokens, canvas_length)
            # the corrector passes are named when they are what takes the request over the cap
            field = max_tokens_field if work // (1 + config.corrector_passes) > limits.max_request_steps \
                else "corrector_steps"
            correctors = f" x (1 + corrector_steps={config.corrector_passes})" if config.corrector_passes else ""
            raise APIError(f"{field}: this request may run {work:,} denoising steps ({choices} choices x "
                           f"{canvases} canvases of {canvas_length} tokens x max_denoising_steps="
                           f"{config.max_denoising_steps}{correctors}); at most {limits.max_request_steps:,} on this "
                           "server (--max-request-steps)", param=field)
    submissions = [Submission(index=p * n + i, prompt=p, config=config,
                              seed=None if seed is None else offset_seed(seed, p * n + i))
                   for p in range(len(prompts)) for i in range(n)]
    return GenerationRequest(kind=kind, prompts=prompts, submissions=submissions, stream=bool(stream),
                             include_usage=include_usage, include_denoising=include_denoising,
                             stop=stop_strings(body.get("stop")), conventions=conventions,
                             max_tokens_field=max_tokens_field if body.get(max_tokens_field) is not None else None,
                             ignored=ignored)


def _ignored(body: dict[str, Any]) -> tuple[str, ...]:
    """The IGNORED fields a request gives (each checked for its type: a malformed one is still a 400)."""
    checks = {"store": (lambda v: isinstance(v, bool), "true or false"),
              "metadata": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                           "an object of strings"),
              "service_tier": (lambda v: isinstance(v, str), "a string")}
    given = []
    for name in IGNORED:
        v = body.get(name)
        if v is None:
            continue
        ok, what = checks[name]
        if not ok(v):
            raise APIError(f"{name}: must be {what}, got {json.dumps(v)}", param=name)
        given.append(name)
    return tuple(given)


def _config(body: dict[str, Any], base: GenerationConfig, max_tokens_field: str) -> GenerationConfig:
    """The request's GenerationConfig: the sampler settings, max_tokens, then temperature's scaling of the schedule."""
    changes = {k: body[k] for k in base.request_settings() if body.get(k) is not None}
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise APIError(f"{max_tokens_field}: must be a positive int, got {max_tokens!r}", param=max_tokens_field)
        changes["max_new_tokens"] = max_tokens
    config = _replace(base, changes, max_tokens_field)
    temperature = body.get("temperature")
    if temperature is not None:
        if not is_real(temperature) or not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise APIError(f"temperature: must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
                           param="temperature")
        if temperature != 1:
            try:
                config = scaled_schedule(config, temperature)
            except ConfigError as e:
                raise APIError(f"temperature: {temperature!r} scales the schedule (t_min={config.t_min!r}, "
                               f"t_max={config.t_max!r}) out of range: {e}", param="temperature") from None
    return config


def scaled_schedule(config: GenerationConfig, temperature: float) -> GenerationConfig:
    """`temperature`'s rule: the sampler's schedule (t_min, t_max) times `temperature`, t_max held at the smallest
    temperature the sampler computes (MIN_TEMPERATURE). So 0, which clients send for greedy decoding, is the
    lowest-temperature schedule: every draw is its position's argmax (the text still depends on the canvas's initial
    noise, that is on `seed`)."""
    return config.replace(t_min=config.t_min * temperature,
                          t_max=max(config.t_max * temperature, MIN_TEMPERATURE))


def _replace(config: GenerationConfig, changes: dict[str, Any], max_tokens_field: str) -> GenerationConfig:
    try:
        return config.replace(**changes)
    except (ConfigError, TypeError) as e:
        message = str(e)
        field = message.split(":", 1)[0]
        param = max_tokens_field if field == "max_new_tokens" else field if field in config.request_settings() else None
        if field == "max_new_tokens":
            message = max_tokens_field + message[len(field):]
        raise APIError(message, param=param) from None


def _check_fields(body: dict[str, Any], known: tuple[str, ...]) -> None:
    allowed = set(known)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(f"unsupported field(s): {', '.join(unknown)} (supported: {', '.join(sorted(allowed))})",
                       param=unknown[0])


def _neutral(body: dict[str, Any], name: str, neutral: tuple[Any, ...], what: str | None = None) -> None:
    v = body.get(name)
    if v is not None and not any(v == x and type(v) is type(x) for x in neutral if x is not None):
        shown = " or ".join(json.dumps(x) for x in neutral)
        raise APIError(f"{name}: not supported here{f' ({what})' if what else ''}; only {shown} is accepted, got "
                       f"{short(v)}", param=name)


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    if options is None:
        return False, False
    if not stream:
        raise APIError("stream_options: only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise APIError(f"stream_options: must be an object, got {options!r}", param="stream_options")
    unknown = sorted(set(options) - {"include_usage", "include_denoising"})
    if unknown:
        raise APIError(f"stream_options: unsupported key(s) {', '.join(unknown)} (supported: include_usage, "
                       "include_denoising)", param="stream_options")
    flags = []
    for key in ("include_usage", "include_denoising"):
        v = options.get(key, False)
        if v not in (None, True, False):
            raise APIError(f"stream_options.{key}: must be true or false, got {v!r}", param="stream_options")
        flags.append(bool(v))
    return flags[0], flags[1]


def _prompts(prompt: Any, tokenizer: Tokenizer) -> list[list[int]]:
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(is_int(t) and t >= 0 for t in v)

    if isinstance(prompt, str):
        rows = [prompt]
    elif ids(prompt):
        return [list(prompt)]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(map(ids, prompt))):
        rows = prompt
    else:
        raise APIError("prompt: must be a string, a list of strings, a non-empty list of token ids (ints >= 0) or a "
                       f"list of such lists, got {short(prompt)}", param="prompt")
    out = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in rows]
    for i, p in enumerate(out):
        if not p:
            raise APIError(f"prompt {i}: empty (it encodes to no tokens)", param="prompt")
    return out


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: content as one string, `developer` as `system`, tool-call
    arguments as objects (transformers' convention)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages: must be a non-empty list of messages, got {short(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where}: must be an object, got {short(m)}", param="messages")
        unknown = sorted(set(m) - set(MESSAGE_KEYS))
        if unknown:
            raise APIError(f"{where}: unsupported key(s) {', '.join(unknown)}", param="messages")
        role = ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise APIError(f"{where}.role: must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                           param="messages")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), where)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise APIError(f"{where}.{key}: must be a string, got {short(m[key])}", param="messages")
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise APIError(f"{where}: only assistant messages carry tool_calls", param="messages")
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in
                                 enumerate(as_list(m["tool_calls"], f"{where}.tool_calls"))]
        if msg["content"] is None and not msg.get("tool_calls"):
            raise APIError(f"{where}.content: required (null only for an assistant message with tool_calls)",
                           param="messages")
        if role == "tool" and "tool_call_id" not in msg:
            raise APIError(f"{where}: a tool message needs tool_call_id", param="messages")
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = as_list(content, f"{where}.content")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                           f"supported, got {kind!r}", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"{where}: must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                       param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        args = load_json(args, what=f"{where}.function.arguments", param="messages") if args.strip() else {}
    if not isinstance(args, dict):
        raise APIError(f"{where}.function.arguments: must be a JSON object", param="messages")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
