"""Sampler settings: `GenerationConfig`, read from and written to transformers' `generation_config.json`, plus
dgemma's switches between the documented reference samplers (docs/sampling.md), each field declared once with its
help and where it goes (the command line's sampler flags, the server's request fields, a trace's summary are built
from it); `GenerationError` and the messages every caller shares (a seed out of range, non-finite logits)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dgemma.model.config import (
    ConfigError,
    ModelConfig,
    is_int,
    is_real,
    is_token_ids,
    parse_json_object,
    require,
    setting,
)

MIN_TEMPERATURE = 1e-6  # below this, logits / T overflow float32 (softcapped logits reach 30)
FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: a larger setting overflows to inf there
# torch's CPU generator (mt19937) keeps only the low 32 bits of the seed manual_seed takes: seeds that differ above
# them draw the same stream, so dgemma accepts the 32-bit seeds, each its own stream on every device.
# repetition_penalty's range: a logit is divided or multiplied by it, then by the temperature (down to
# MIN_TEMPERATURE / max_denoising_steps): 100 already takes a logit of 30 to 0.3 (or -30 to -3000), and 5e-324 is 0 in
# float32 (a division by zero)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_MAX = 2**32 - 1
SEED_RANGE = f"an int from 0 to {SEED_MAX} (2**32 - 1)"  # what every seed error says


def is_seed(v: Any) -> bool:
    """An int in [0, SEED_MAX]: the seeds dgemma accepts (the command line, TrainConfig, requests). One rule, called
    by every place that checks a seed (their messages say SEED_RANGE), so a seed is refused up front rather than
    silently drawing another seed's stream."""
    return is_int(v) and 0 <= v <= SEED_MAX


def seed_problem(seed: Any, given: str | None = None) -> str | None:
    """None for a seed dgemma accepts (`is_seed`), else what every seed error says after the seed's name: "must be
    <SEED_RANGE>, got <the seed>" (`given`: the text the command line parsed it from)."""
    if is_seed(seed):
        return None
    return f"must be {SEED_RANGE}, got {repr(seed) if given is None else repr(given)}"


def offset_seed(seed: int, k: int) -> int:
    """The k-th seed derived from `seed` (prompt i of an evaluation, turn k of a chat): seed + k, wrapped into
    [0, SEED_MAX] so that every accepted seed, SEED_MAX included, derives seeds torch.Generator takes."""
    return (seed + k) % (SEED_MAX + 1)


def check_floats(obj: Any) -> None:
    """Every `float` field of the dataclass `obj` is a finite number that float32 holds (|x| <= FLOAT32_MAX): what
    the sampler computes in, so a value beyond it (t_max=4e38 from the command line, 1e308 from a request) is an
    error naming the field, not an overflow to inf that returns no tokens."""
    for f in dataclasses.fields(obj):
        if f.type == "float":
            v = getattr(obj, f.name)
            require(is_real(v) and abs(v) <= FLOAT32_MAX, f.name,
                    f"must be a finite number within float32's range (|x| <= {FLOAT32_MAX:.4g}), got {v!r}")


class GenerationError(ValueError):
    """Generation cannot go on: non-finite logits (NaN or inf weights or activations), a bad seed or canvas. The
    message names the canvas and step, or the argument and its value."""


def non_finite_logits(canvas_index: int, step: int, rows: list[int] | None = None) -> GenerationError:
    """The error of NaN or inf logits at a denoising step (`rows`: the batch rows holding them, where known), which
    every sampler loop raises before the draw: torch.multinomial would fail obscurely or a sampler pick token 0."""
    where = f"canvas {canvas_index}, step {step}" + (f" (batch rows {rows[:8]})" if rows is not None else "")
    return GenerationError(f"non-finite logits at {where}: the model's weights or activations hold NaN or inf (check "
                           "the checkpoint; try float32)")


SAMPLERS = ("entropy-bound", "lite", "ancestral", "predictor-corrector", "block-refinement", "confidence")
CHAINS = ("ancestral", "predictor-corrector")  # samplers that run the reverse chain to s = 0, N steps a canvas
COMMITTING = ("block-refinement", "confidence")  # samplers whose committed positions are final (unless edited)
TIME_LEVELS = ("canvas", "schedule", "noise")
# the sampling controls on every step's draw (rules.penalize, filter_tokens): their defaults leave the draw untouched
CONTROLS = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
LITE_COMMITS = ("scheduled", "seed")
# The settings generation_config.json carries (entropy_bound under sampler_config): a checkpoint's own values, the
# defaults below without one. Every other field is dgemma's, never written to the file.
CHECKPOINT_KEYS = ("max_new_tokens", "max_length", "max_denoising_steps", "entropy_bound", "t_min", "t_max",
                   "stability_threshold", "confidence_threshold", "eos_token_id", "pad_token_id", "bos_token_id")
# The groups of the command line's sampler flags by title (a field's `group`, "sampler" unless it says), and what
# each holds; every flag overrides the checkpoint's generation_config.json for the run
GROUPS = {"sampler": "the sampler and its schedule (docs/sampling.md)",
          "reference switches": "between the documented reference implementations (docs/sampling.md, \"Switches\")",
          "sampling controls": "on every denoising step's draw, as OpenAI's and vLLM's fields mean them "
                               "(docs/sampling.md, \"Sampling controls\")"}


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Sampler settings, read from `generation_config.json` (`entropy_bound` sits under `sampler_config`).
    Defaults are transformers' global defaults for DiffusionGemma.

    Each field is declared once, with what the command line and the server say of it (model/config.py: `setting`):
    its help, its `choices`, and in `metadata` where it goes. Every field is, unless it says otherwise, a flag of
    `dgemma generate`, `chat` and `serve` (`flag=False`: none), a field a server request may set (`request=False`:
    not one; `request_settings`), and a key of a trace's summary (`summary`); `group` places its flag in `--help`
    (GROUPS), `metavar` names its value there and `shown` says its default in words."""

    max_new_tokens: int = setting("tokens to generate", 256, metavar="N",
                                  request=False)  # the server's requests name it as OpenAI does: max_tokens
    max_length: int | None = setting("the most tokens of context and output together (transformers' rule: it "
                                     "applies only while max_new_tokens is 256)", None, flag=False, request=False)
    max_denoising_steps: int = setting("the most denoising steps per canvas; the sampler may stop earlier", 48,
                                       metavar="N")
    entropy_bound: float = setting("entropy budget of a denoising step", 0.1)
    # The temperature falls linearly from t_max (the first step) towards t_min (rules.temperature); t_min = t_max is
    # a constant temperature (t_min = t_max = 1 with self_conditioning off: the ancestral sampler is then the chain
    # the NELBO bounds, families.chain_likelihood)
    t_min: float = setting("final temperature (t_max = t_min: constant)", 0.4)
    t_max: float = setting("initial temperature", 0.8)
    self_conditioning: str = setting("on: each step reads the previous step's posterior (transformers); off: no step "
                                     "does (the reverse chain the NELBO describes: docs/sampling.md)", "on",
                                     choices=("on", "off"))
    stability_threshold: int = setting("stop rule: steps the argmax must stay unchanged before a canvas stops", 1,
                                       metavar="N")
    confidence_threshold: float = setting("stop rule: the mean entropy (nats) under which a canvas may stop", 0.005)
    eos_token_id: tuple[int, ...] = setting("the tokens that end the output", (), flag=False, request=False)
    pad_token_id: int | None = setting("the token after the end of a finished row", None, flag=False, request=False)
    bos_token_id: int | None = setting("the token that begins a sequence", None, flag=False, request=False)
    # The samplers (docs/sampling.md): "entropy-bound" (transformers), "lite" (seed 003: monotone commits),
    # "ancestral" (the D3PM reverse chain: each step draws x_{s - 1/N} from the model's reverse step; at the default
    # temperatures (0.8 -> 0.4) and with self-conditioning it is a tempered, self-conditioned chain that no likelihood
    # describes; with t_min = t_max = 1 and self_conditioning off it is the chain the NELBO at T = N bounds,
    # families.chain_likelihood),
    # "predictor-corrector" (each ancestral step followed by `corrector_steps` forward-backward corrector passes),
    # "block-refinement" (diffusers: commit the positions above `commit_threshold` and at least ceil(L * k / N) after
    # step k; `edit_threshold` lets a committed token change) or "confidence" (Fast-dLLM: commit the positions above
    # `commit_threshold`, at least one a step).
    sampler: str = setting("the sampler; entropy-bound is transformers'", "entropy-bound", choices=SAMPLERS)
    corrector_steps: int = setting("predictor-corrector: corrector passes after each ancestral step", 1, metavar="K")
    commit_threshold: float = setting("block-refinement, confidence: a drawn token at least this probable commits "
                                      "(diffusers' threshold)", 0.95, metavar="P")
    edit_threshold: float | None = setting("block-refinement, confidence: a committed token changes to a new draw "
                                           "this probable (diffusers' editing_threshold)", None, metavar="P",
                                           shown="never")
    # dgemma's switches between the documented reference implementations (defaults = transformers), docs/sampling.md
    commit: str | None = setting("what a finished canvas commits: argmax (transformers, vLLM) or sample (the JAX "
                                 "reference's final canvas; for lite, DiffusionGemma-Lite's committed tokens, else the "
                                 "last draw)", None, choices=(None, "argmax", "sample"), group="reference switches",
                                 shown="sample for lite, the chains and the committing samplers, else argmax",
                                 traced_as="commit_rule")
    stop_rule: str = setting("hf: argmax stable over history and confident; jax: argmax equal to the input canvas "
                             "and confident", "hf", choices=("hf", "jax"), group="reference switches")
    sliding_prefix: str = setting("committed tokens a canvas sees in sliding layers: hf sliding_window - 1, jax "
                                  "sliding_window", "hf", choices=("hf", "jax"), group="reference switches")
    truncate: bool = setting("cut the output to max_new_tokens (transformers keeps whole canvases)", False,
                             flag=False, request=False)  # generate()'s; the server cuts at max_tokens itself
    adaptive: bool = setting("lite: stop once the mean entropy stays under confidence_threshold for stability_steps "
                             "steps", True, group="reference switches")
    stability_steps: int = setting("lite: calm steps in a row before the adaptive stop", 2, group="reference switches")
    posterior: str | None = setting("which distribution entropy, confidence and the self-conditioning input read: "
                                    "tempered (logits / T, as transformers) or raw (the untempered posterior, as "
                                    "DiffusionGemma-Lite reads it); the draw is always tempered", None,
                                    choices=(None, "tempered", "raw"), group="reference switches",
                                    shown="raw for lite, else tempered", traced_as="posterior_rule")
    initial_self_conditioning: str = setting("the first step's self-conditioning input: zeros (transformers: the MLP "
                                             "adds nothing) or uniform (the mean token embedding)", "zeros",
                                             choices=("zeros", "uniform"), group="reference switches")
    # dgemma's own choices, measured in docs/sampling.md (transformers' models have no time embedding and no Lite)
    time_level: str = setting("noise level told to a time-embedding model (rules.time_level): canvas (what the "
                              "canvas holds), schedule (n/N, DiffusionGemma's original) or noise (always 1)",
                              "canvas", choices=TIME_LEVELS)
    lite_commit: str = setting("Lite's commit rule (rules.lite_commit): scheduled (the most confident candidates, "
                               "up to ceil(L * k / N) after step k) or seed (all at once, as the DiffusionGemma-Lite "
                               "paper)", "scheduled",
                               choices=LITE_COMMITS)
    # Sampling controls on every step's draw (docs/sampling.md, "Sampling controls"); their neutral values (the
    # defaults) leave the transformers-identical path untouched. Not part of generation_config.json.
    top_k: int = setting("keep each position's K most probable tokens (0: all)", 0, metavar="K",
                         group="sampling controls")
    top_p: float = setting("keep the fewest most probable tokens of each position that reach probability P", 1.0,
                           metavar="P", group="sampling controls")
    min_p: float = setting("keep the tokens at least P times as probable as the position's most probable one", 0.0,
                           metavar="P", group="sampling controls")
    repetition_penalty: float = setting("> 1 makes tokens of the prompt and the output so far less likely (their "
                                        "logits divided, or multiplied when negative, by it)", 1.0,
                                        group="sampling controls")
    presence_penalty: float = setting("subtracted from the logits of tokens the output holds ([-2, 2])", 0.0,
                                      group="sampling controls")
    frequency_penalty: float = setting("subtracted once per occurrence in the output ([-2, 2])", 0.0,
                                       group="sampling controls")
    logit_bias: tuple[tuple[int, float], ...] = setting("added to those tokens' logits ([-100, 100])", (),
                                                        metavar="ID=BIAS[,ID=BIAS]", group="sampling controls",
                                                        shown="none")  # (id, bias) pairs; a dict is accepted

    def __post_init__(self) -> None:
        eos = self.eos_token_id
        require(is_token_ids(eos), "eos_token_id", f"must be an int >= 0 or a list of them, got {eos!r}")
        eos = () if eos is None else (eos,) if is_int(eos) else tuple(eos)  # type: ignore[arg-type]
        object.__setattr__(self, "eos_token_id", eos)
        require(is_int(self.max_new_tokens) and self.max_new_tokens > 0, "max_new_tokens",
               f"must be a positive int, got {self.max_new_tokens!r}")
        require(self.max_length is None or (is_int(self.max_length) and self.max_length > 0), "max_length",
               f"must be a positive int or None, got {self.max_length!r}")
        require(is_int(self.max_denoising_steps) and self.max_denoising_steps > 0, "max_denoising_steps",
               f"must be a positive int, got {self.max_denoising_steps!r}")
        check_floats(self)
        require(self.entropy_bound > 0, "entropy_bound", f"must be a number > 0, got {self.entropy_bound!r}")
        require(self.t_min >= 0, "t_min", f"must be >= 0, got {self.t_min!r}")
        require(self.t_max >= self.t_min, "t_max", f"must be >= t_min={self.t_min!r} (equal: a constant "
                f"temperature), got {self.t_max!r}")
        require(self.t_max >= MIN_TEMPERATURE, "t_max", f"must be >= {MIN_TEMPERATURE} (a smaller temperature "
               f"overflows the tempered logits), got {self.t_max!r}")
        require(is_int(self.stability_threshold) and self.stability_threshold >= 0, "stability_threshold",
               f"must be an int >= 0, got {self.stability_threshold!r}")
        require(self.confidence_threshold > 0, "confidence_threshold",
               f"must be > 0, got {self.confidence_threshold!r}")
        require(is_int(self.corrector_steps) and self.corrector_steps >= 0, "corrector_steps",
               f"must be an int >= 0, got {self.corrector_steps!r}")
        require(0 <= self.commit_threshold <= 1, "commit_threshold",
               f"must be a probability in [0, 1], got {self.commit_threshold!r}")
        e = self.edit_threshold
        require(e is None or (is_real(e) and 0 < e <= 1), "edit_threshold",
               f"must be None (no editing) or a probability in (0, 1], got {e!r}")
        for name in ("pad_token_id", "bos_token_id"):
            v = getattr(self, name)
            require(v is None or (is_int(v) and v >= 0), name, f"must be an int >= 0 or None, got {v!r}")
        for name in ("truncate", "adaptive"):
            require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            v = getattr(self, f.name)
            require(choices is None or v in choices, f.name,
                    f"must be one of {', '.join(map(repr, choices or ()))}, got {v!r}")
        require(self.self_conditioning == "on" or self.initial_self_conditioning == "zeros",
                "initial_self_conditioning", f"{self.initial_self_conditioning!r} is the first step's "
                "self-conditioning input, and self_conditioning='off' feeds none to any step: leave it 'zeros'")
        require(is_int(self.stability_steps) and self.stability_steps >= 1, "stability_steps",
               f"must be an int >= 1, got {self.stability_steps!r}")
        require(is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an int >= 0 (0: off), got {self.top_k!r}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        require(lo <= self.repetition_penalty <= hi, "repetition_penalty",
                f"must be in [{lo:g}, {hi:g}] (1: off; farther out, the penalized logits leave what float32 holds), "
                f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def penalizes(self) -> bool:
        """Whether a penalty or a bias changes the logits (which then need the prompt and output so far)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias))

    @property
    def active_controls(self) -> list[str]:
        """The sampling controls (CONTROLS) set away from their neutral values (the defaults), as "name=value"."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        return [f"{k}={getattr(self, k)!r}" for k in CONTROLS if getattr(self, k) != fields[k].default]

    @property
    def filters_tokens(self) -> bool:
        """Whether top_k, top_p or min_p filters the tempered distribution (`rules.filter_tokens`)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    @property
    def commit_rule(self) -> str:
        """The resolved `commit` switch."""
        return self.commit or ("sample" if self.sampler in ("lite", *CHAINS, *COMMITTING) else "argmax")

    @property
    def corrector_passes(self) -> int:
        """The corrector passes after each step: `corrector_steps` for the predictor-corrector sampler, else 0."""
        return self.corrector_steps if self.sampler == "predictor-corrector" else 0

    @property
    def max_passes(self) -> int:
        """The most model passes a canvas takes: max_denoising_steps, each with its `corrector_passes`."""
        return self.max_denoising_steps * (1 + self.corrector_passes)

    @property
    def posterior_rule(self) -> str:
        """The resolved `posterior` switch."""
        return self.posterior or ("raw" if self.sampler == "lite" else "tempered")

    @classmethod
    def flags(cls) -> tuple[dataclasses.Field[Any], ...]:
        """The fields with a command-line flag (`dgemma generate`, `chat`, `serve`), in declaration order."""
        return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("flag", True))

    @classmethod
    def request_settings(cls) -> tuple[str, ...]:
        """The fields a server request may set, by name (docs/serving.md): each checked as `replace` checks it."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("request", True))

    def summary(self) -> dict[str, Any]:
        """The settings a trace records: generation_config.json's (`to_hf`), then every other field, a switch left
        to the sampler as the value it resolved to (`commit` as `commit_rule`, `posterior` as `posterior_rule`)."""
        names = [f.metadata.get("traced_as", f.name) for f in dataclasses.fields(self) if f.name not in CHECKPOINT_KEYS]
        return self.to_hf() | {name: getattr(self, name) for name in names}

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with `changes`; unknown names raise a ConfigError listing the valid ones."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        return dataclasses.replace(self, **changes)

    def overrides(self, **changes: Any) -> dict[str, Any]:
        """`generate()`'s keyword overrides: the `changes` that are not None, each checked against this config first
        (an invalid value or an unknown name raises a ConfigError naming the field)."""
        kw = {k: v for k, v in changes.items() if v is not None}
        self.replace(**kw)
        return kw

    @classmethod
    def for_model(cls, config: ModelConfig) -> GenerationConfig:
        """transformers' defaults with the model's own special tokens: the settings of a model that comes without a
        generation_config.json (a preset with random weights)."""
        eos = config.eos_token_id if isinstance(config.eos_token_id, tuple) else (config.eos_token_id,)
        return cls(eos_token_id=tuple(e for e in eos if e is not None), pad_token_id=config.pad_token_id,
                   bos_token_id=config.bos_token_id)

    def stopping_at(self, token_id: int | None) -> GenerationConfig:
        """A copy that also stops at `token_id` (Gemma's generation_config.json stops at the chat template's <turn|>);
        itself when it already does or `token_id` is None."""
        if token_id is None or token_id in self.eos_token_id:
            return self
        return self.replace(eos_token_id=(*self.eos_token_id, token_id))

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "generation_config.json") -> GenerationConfig:
        """Read generation_config.json; every problem raises ConfigError naming `source`, the key and the value."""
        return parse_json_object(cls._from_hf, d, source, "generation config")

    @classmethod
    def _from_hf(cls, d: dict[str, Any], source: str) -> GenerationConfig:
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in CHECKPOINT_KEYS and f.name != "entropy_bound" and d.get(f.name) is not None:
                kw[f.name] = d[f.name]
        sc = d.get("sampler_config")
        if sc is not None:
            if not isinstance(sc, dict) or "entropy_bound" not in sc:
                raise ConfigError(f"{source}: sampler_config must be an object with 'entropy_bound', got {sc!r}")
            kw["entropy_bound"] = sc["entropy_bound"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        eos: int | list[int] | None = list(self.eos_token_id) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        d: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "max_denoising_steps": self.max_denoising_steps,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": float(self.entropy_bound)},
            "t_min": self.t_min,
            "t_max": self.t_max,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "return_dict_in_generate": True,
        }
        for k, v in (("max_length", self.max_length), ("eos_token_id", eos), ("pad_token_id", self.pad_token_id),
                     ("bos_token_id", self.bos_token_id)):
            if v is not None:
                d[k] = v
        return d


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, from pairs or a {id: bias} dict (ids may be digit strings, as JSON
    keys are); each bias a finite number in [-100, 100] (OpenAI's range)."""
    items = v.items() if isinstance(v, dict) else v
    try:
        pairs = [(int(k) if isinstance(k, str) and k.isdigit() else k, b) for k, b in items]
    except (TypeError, ValueError):
        pairs = None
    require(pairs is not None and all(is_int(k) and k >= 0 and is_real(b) and -100 <= b <= 100 for k, b in pairs),
            "logit_bias", f"must map token ids (ints >= 0) to biases in [-100, 100], got {v!r}")
    return tuple(sorted(dict(pairs).items()))  # type: ignore[arg-type]

