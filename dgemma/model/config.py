"""Configs: frozen dataclasses whose field names are the checkpoint's JSON names.

`ModelConfig.from_hf(config_json)` reads a Hugging Face `config.json` (a top-level `diffusion_gemma` config
with a `text_config`, or a bare text config); `GenerationConfig.from_hf(generation_config_json)` reads
`generation_config.json`. Both write the same layout back with `to_hf()`. Invalid values fail at
construction with the field's name. Named presets live in `PRESETS`. What every config shares lives here too:
`ConfigError`, the value checks, and `setting`, the field that carries its help (GenerationConfig, TrainConfig).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from dgemma.io import fsio

TIME_FEATURES = 256  # width of the sinusoidal noise-level features a time-embedding model (Lite) projects
SLIDING = "sliding_attention"
FULL = "full_attention"
T = TypeVar("T")
LayerType = Literal["sliding_attention", "full_attention"]


class ConfigError(ValueError):
    """A config value is invalid; the message names the field (and the file, when read from one)."""


def require(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {msg}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A finite int or float (not a bool, a string, NaN or an infinity: JSON's `Infinity` parses to a float)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_token_ids(v: Any) -> bool:
    """None, an int >= 0, or a list/tuple of them."""
    ids = () if v is None else (v,) if not isinstance(v, (list, tuple)) else tuple(v)
    return all(is_int(i) and i >= 0 for i in ids)


def setting(help: str, default: Any, **meta: Any) -> Any:
    """A config field that says what it is: its `help` (without the default, which whoever shows the field reads from
    the dataclass) and `meta` (its `choices`, and the keys its config documents: GenerationConfig's say which flag,
    request field and group it is). `dgemma`'s flags, the server's request fields and the trace summaries are built
    from these, so a field is named once: where it is declared."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


PARSE_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One layer type's rotary embedding. `proportional` rotates the first `partial_rotary_factor` of the
    frequency pairs of an ordinary `head_dim` RoPE and leaves the rest unrotated (Gemma 4 full layers)."""

    rope_type: Literal["default", "proportional"] = "default"
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        require(self.rope_type in ("default", "proportional"), "rope_type",
               f"must be 'default' or 'proportional', got {self.rope_type!r}")
        require(is_real(self.rope_theta) and self.rope_theta > 0, "rope_theta",
               f"must be > 0 (and finite), got {self.rope_theta!r}")
        require(is_real(self.partial_rotary_factor) and 0.0 <= self.partial_rotary_factor <= 1.0,
               "partial_rotary_factor", f"must be in [0, 1], got {self.partial_rotary_factor!r}")
        require(is_real(self.factor) and self.factor > 0, "factor", f"must be > 0 (and finite), got {self.factor!r}")
        if self.rope_type == "default":
            # transformers sizes a default RoPE's cos/sin by the partial width but applies it to the whole head,
            # which fails for any factor < 1; only proportional RoPE is partial.
            require(self.partial_rotary_factor == 1.0, "partial_rotary_factor",
                   "must be 1.0 for rope_type 'default' (use 'proportional' for partial RoPE)")
            require(self.factor == 1.0, "factor", "must be 1.0 for rope_type 'default'")

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str) -> RopeConfig:
        known = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
        require(isinstance(d, dict), where, f"must be an object of RoPE settings, got {d!r}")
        extra = set(d) - known
        require(not extra, where, f"unsupported RoPE keys {sorted(extra)} (supported: {sorted(known)})")
        try:
            return cls(**{k: d[k] for k in known if k in d})
        except ConfigError as e:
            raise ConfigError(f"{where}.{e}") from None

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "proportional":
            d["partial_rotary_factor"] = self.partial_rotary_factor
            if self.factor != 1.0:
                d["factor"] = self.factor
        return d


def default_layer_types(num_layers: int) -> tuple[LayerType, ...]:
    """transformers' layer pattern, 5 sliding : 1 full: every 6th layer full, and the last layer always full."""
    return tuple(FULL if (i + 1) % 6 == 0 or i == num_layers - 1 else SLIDING for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Geometry of a DiffusionGemma text model. Per-layer geometry comes from `layer_types`: full-attention
    layers use `global_head_dim` and `num_global_key_value_heads`, sliding layers `head_dim` and
    `num_key_value_heads` (see `layer_head_dim` / `layer_num_kv_heads`).

    The defaults are transformers' (`DiffusionGemmaTextConfig`): what a config.json that omits a key means. The
    released 26B-A4B geometry is the preset `diffusiongemma-26b-a4b`."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None  # None: as num_key_value_heads
    layer_types: tuple[LayerType, ...] = ()  # empty: default_layer_types(num_hidden_layers)
    sliding_window: int = 512
    sliding_rope: RopeConfig = RopeConfig("default", 10_000.0)
    full_rope: RopeConfig = RopeConfig("proportional", 1_000_000.0, 0.25)
    num_experts: int = 0  # 0 = dense feed-forward only (a dgemma extension for small from-scratch models)
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    canvas_length: int = 256
    max_position_embeddings: int = 131_072
    hidden_activation: str = "gelu_pytorch_tanh"
    use_bidirectional_attention: str | None = None
    pad_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    bos_token_id: int | None = 2
    # dgemma extensions for models trained from scratch (seed 003's Lite); defaults = DiffusionGemma.
    attention_k_eq_v: bool = True  # full-attention layers use the raw k_proj output as V (no v_proj)
    self_conditioning: str = "mlp"  # "mlp": gated MLP on the canvas input; "linear": zero-init proj on the output
    time_embedding: bool = False  # add a per-canvas sinusoidal embedding of the noise level t/T to each token
    # p(x0 | x_s): the network's prediction times q(x_s | x0) of each token's own observation
    # (dgemma/diffusion/noise.py:observe)
    observed_likelihood: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "global_head_dim", "sliding_window", "canvas_length",
                     "max_position_embeddings"):
            v = getattr(self, name)
            require(is_int(v) and v > 0, name, f"must be a positive int, got {v!r}")
        require(isinstance(self.layer_types, (tuple, list)), "layer_types",
               f"must be a list of {SLIDING!r} / {FULL!r}, got {self.layer_types!r}")
        types = self.layer_types or default_layer_types(self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            require(is_token_ids(v) and (name == "eos_token_id" or not isinstance(v, (list, tuple))), name,
                   f"must be an int >= 0{' (or a list of them)' if name == 'eos_token_id' else ''} or None, got {v!r}")
        for name in ("head_dim", "global_head_dim"):
            require(getattr(self, name) % 2 == 0, name, f"must be even for rotate-half RoPE, got {getattr(self, name)}")
        require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
               f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = [t for t in self.layer_types if not isinstance(t, str) or t not in (SLIDING, FULL)]
        require(not bad, "layer_types", f"entries must be {SLIDING!r} or {FULL!r}, got {bad[0]!r}" if bad else "")
        require(self.layer_types[-1] == FULL, "layer_types",
               "the last layer must be 'full_attention' (transformers forces it; a checkpoint saying otherwise is "
               "inconsistent)")
        if self.num_global_key_value_heads is None:  # transformers: full layers then keep num_key_value_heads
            object.__setattr__(self, "num_global_key_value_heads", self.num_key_value_heads)
        nkv_full = self.num_global_key_value_heads
        require(nkv_full is None or (is_int(nkv_full) and nkv_full > 0), "num_global_key_value_heads",
               f"must be a positive int or None, got {nkv_full!r}")
        for name, nkv in (("num_key_value_heads", self.num_key_value_heads),
                          ("num_global_key_value_heads", self.num_global_key_value_heads)):
            if nkv is not None:
                require(self.num_attention_heads % nkv == 0, name,
                       f"{nkv} must divide num_attention_heads={self.num_attention_heads} (grouped-query attention)")
        require(is_int(self.num_experts) and self.num_experts >= 0, "num_experts",
               f"must be an int >= 0, got {self.num_experts!r}")
        if not self.num_experts:  # dense: the MoE sizes mean nothing; one canonical form keeps configs comparable
            object.__setattr__(self, "top_k_experts", 0)
            object.__setattr__(self, "moe_intermediate_size", 0)
        if self.num_experts:
            require(is_int(self.top_k_experts) and 0 < self.top_k_experts <= self.num_experts, "top_k_experts",
                   f"must be in [1, num_experts={self.num_experts}], got {self.top_k_experts!r}")
            require(is_int(self.moe_intermediate_size) and self.moe_intermediate_size > 0, "moe_intermediate_size",
                   f"must be a positive int, got {self.moe_intermediate_size!r}")
        require(is_real(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps",
               f"must be > 0 (and finite), got {self.rms_norm_eps!r}")
        sc = self.final_logit_softcapping
        require(sc is None or (is_real(sc) and sc > 0), "final_logit_softcapping",
               f"must be > 0 or None (and finite), got {sc!r}")
        for name in ("attention_k_eq_v", "time_embedding", "observed_likelihood"):
            require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        require(self.hidden_activation in ("gelu_pytorch_tanh", "gelu_tanh"), "hidden_activation",
               f"only 'gelu_pytorch_tanh' (alias 'gelu_tanh') is supported, got {self.hidden_activation!r}")
        require(self.use_bidirectional_attention in (None, "vision"), "use_bidirectional_attention",
               f"only None or 'vision' (a causal encoder for text) are supported, got "
               f"{self.use_bidirectional_attention!r}")
        require(self.self_conditioning in ("mlp", "linear"), "self_conditioning",
               f"must be 'mlp' or 'linear', got {self.self_conditioning!r}")
        require(isinstance(self.sliding_rope, RopeConfig) and isinstance(self.full_rope, RopeConfig),
               "rope", "sliding_rope and full_rope must be RopeConfig")

    # --- derived per-layer geometry -------------------------------------------------------------------------
    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def layer_num_kv_heads(self, i: int) -> int:
        return self.num_key_value_heads if self.is_sliding(i) else self.num_global_key_value_heads  # type: ignore

    def shares_kv(self, i: int) -> bool:
        """Whether layer i takes its values from k_proj (K=V) instead of a v_proj."""
        return self.attention_k_eq_v and not self.is_sliding(i)

    def layer_rope(self, i: int) -> RopeConfig:
        return self.sliding_rope if self.is_sliding(i) else self.full_rope

    def rotary_dims(self, i: int) -> int:
        """How many of the layer's head dims are rotated (the rest pass through unchanged)."""
        rope, hd = self.layer_rope(i), self.layer_head_dim(i)
        return hd if rope.rope_type == "default" else 2 * int(rope.partial_rotary_factor * hd // 2)

    def first_layer_of_each_type(self) -> dict[str, int]:
        """The index of the first layer of each layer type ("sliding_attention" -> 0, "full_attention" -> 5, ...)."""
        first: dict[str, int] = {}
        for i, t in enumerate(self.layer_types):
            first.setdefault(t, i)
        return first

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # --- Hugging Face config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a `diffusion_gemma` config (with `text_config`) or a bare `diffusion_gemma_text` config. Every
        problem raises ConfigError naming `source`, the key and the value."""
        return parse_json_object(cls._from_hf, cfg, source, "config")

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any], source: str) -> ModelConfig:
        top: dict[str, Any] = {}
        text = cfg
        if "text_config" in cfg:
            top, text = cfg, cfg["text_config"]
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: text_config must be an object, got {type(text).__name__}")
        mt = text.get("model_type")
        if mt is not None and mt not in ("diffusion_gemma_text", "diffusion_gemma"):
            raise ConfigError(f"{source}: model_type {mt!r} is not a DiffusionGemma text config")
        if top.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
            raise ConfigError(f"{source}: tie_word_embeddings=false (separate encoder/decoder/head weights) is not "
                              "supported; DiffusionGemma ties them")
        kw: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"sliding_rope", "full_rope", "canvas_length"}
        for name in names:
            if name in text and (text[name] is not None or name.endswith("token_id")):  # None: "no such token"
                kw[name] = text[name]
        if isinstance(kw.get("layer_types"), list):
            kw["layer_types"] = tuple(kw["layer_types"])
        if "eos_token_id" in kw and isinstance(kw["eos_token_id"], list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if name in text and text[name] is None:  # transformers writes None for "no MoE"
                kw[name] = 0
        # final_logit_softcapping is a class attribute in transformers, never in config.json: the default 30 holds.
        canvas = top.get("canvas_length", text.get("canvas_length"))
        if canvas is not None:
            kw["canvas_length"] = canvas
        # Full-attention geometry comes either as global_head_dim / num_global_key_value_heads (Google's
        # config.json) or as per_layer_config overrides (what transformers' save_pretrained writes).
        plc = text.get("per_layer_config")
        if plc is not None:  # {} too: transformers writes {} when full layers share the sliding geometry
            kw.update(_geometry_from_per_layer_config(plc, text, source))
        rope = text.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, dict) or not set(rope) <= {SLIDING, FULL}:
                raise ConfigError(f"{source}: rope_parameters must map {SLIDING!r}/{FULL!r} to RoPE settings, "
                                  f"got {rope!r}")
            if SLIDING in rope:
                kw["sliding_rope"] = RopeConfig.from_hf(rope[SLIDING], f"{source}: rope_parameters.{SLIDING}")
            if FULL in rope:
                kw["full_rope"] = RopeConfig.from_hf(rope[FULL], f"{source}: rope_parameters.{FULL}")
        # Keys config.json omits (layer_types included) take the dataclass defaults, which are transformers'.
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` that transformers 5.23's `save_pretrained` writes (text part; the vision tower of a
        text-only model is a minimal placeholder that transformers can build)."""
        text: dict[str, Any] = {
            "model_type": "diffusion_gemma_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_activation": self.hidden_activation,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "tie_word_embeddings": True,
            "rope_parameters": {SLIDING: self.sliding_rope.to_hf(), FULL: self.full_rope.to_hf()},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "use_bidirectional_attention": self.use_bidirectional_attention,
            "num_experts": self.num_experts or None,
            "top_k_experts": self.top_k_experts if self.num_experts else None,
            "moe_intermediate_size": self.moe_intermediate_size if self.num_experts else None,
            "per_layer_config": self._per_layer_config(),
        }
        if self.final_logit_softcapping != 30.0:
            text["final_logit_softcapping"] = self.final_logit_softcapping
        if self.self_conditioning != "mlp" or self.time_embedding or not self.attention_k_eq_v:  # dgemma-only
            text["self_conditioning"] = self.self_conditioning
            text["time_embedding"] = self.time_embedding
            text["attention_k_eq_v"] = self.attention_k_eq_v
        if self.observed_likelihood:  # dgemma-only: transformers' sampler would read the network's logits raw
            text["observed_likelihood"] = True
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": True,
            "text_config": text,
            "vision_config": _MINIMAL_VISION_CONFIG,
        }

    def _per_layer_config(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        width = len(str(self.num_hidden_layers - 1))
        for i, t in enumerate(self.layer_types):
            if t != FULL:
                continue
            o: dict[str, int] = {}
            if self.global_head_dim != self.head_dim:
                o["head_dim"] = self.global_head_dim
            nkv = self.layer_num_kv_heads(i)
            if nkv != self.num_key_value_heads:
                o["num_key_value_heads"] = nkv
            if o:
                out[str(i).zfill(width)] = o
        return out


def _geometry_from_per_layer_config(plc: Any, text: dict[str, Any], source: str) -> dict[str, Any]:
    if not isinstance(plc, dict):
        raise ConfigError(f"{source}: per_layer_config must be an object keyed by layer index, got {plc!r}")
    types = text.get("layer_types") if isinstance(text.get("layer_types"), list) else []
    head_dim = text.get("head_dim", 256)
    nkv = text.get("num_key_value_heads", 4)
    full_geoms: set[tuple[int, int]] = set()
    for key, over in plc.items():
        try:
            i = int(key)
        except ValueError:
            raise ConfigError(f"{source}: per_layer_config key {key!r} is not a layer index") from None
        if not isinstance(over, dict) or i < 0:
            raise ConfigError(f"{source}: per_layer_config[{key!r}] must be an object overriding a layer's geometry "
                              f"(keyed by a layer index >= 0), got {over!r}")
        extra = set(over) - {"head_dim", "num_key_value_heads"}
        if extra:
            raise ConfigError(f"{source}: per_layer_config[{key!r}] overrides {sorted(extra)}; dgemma supports "
                              "only head_dim and num_key_value_heads on full-attention layers")
        if types and (i >= len(types) or types[i] != FULL):
            raise ConfigError(f"{source}: per_layer_config[{key!r}] overrides a layer that is not full_attention")
        geom = (over.get("head_dim", head_dim), over.get("num_key_value_heads", nkv))
        if not all(is_int(v) and v > 0 for v in geom):
            raise ConfigError(f"{source}: per_layer_config[{key!r}]: head_dim and num_key_value_heads must be positive "
                              f"ints, got {over!r}")
        full_geoms.add(geom)
    n_full = sum(t == FULL for t in types) if types else len(plc)
    if len(full_geoms) > 1 or (full_geoms and len(plc) != n_full):
        raise ConfigError(f"{source}: per_layer_config gives full-attention layers different geometries "
                          f"({sorted(full_geoms)}); every full layer must share one head_dim and kv-head count")
    ghd, gnkv = full_geoms.pop() if full_geoms else (head_dim, nkv)
    return {"global_head_dim": ghd, "num_global_key_value_heads": gnkv}


# A vision tower transformers can build for a text-only checkpoint (dgemma never runs it).
_MINIMAL_VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 64,
    "patch_size": 4, "pooling_kernel_size": 2,
}


def parse_json_object(parse: Callable[[dict[str, Any], str], T], obj: Any, source: str, what: str) -> T:
    """`parse(obj, source)` for a JSON object read from `source`, with one ConfigError naming `source` for anything
    wrong: not an object, a ConfigError of `parse`, or a value of a type no check anticipated."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    try:
        return parse(obj, source)
    except ConfigError:
        raise
    except PARSE_ERRORS as e:
        raise ConfigError(f"{source}: malformed {what} ({type(e).__name__}: {e})") from None


MAX_JSON_BYTES = 64 * 2**20  # a config, an index or an adapter config: far larger than any real one


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object (at most MAX_JSON_BYTES), with an error that names the file on any failure."""
    path = Path(path)
    try:  # a regular file (or a symlink to one): a FIFO is refused, never blocks; at most MAX_JSON_BYTES read
        text = fsio.read_bytes(path, MAX_JSON_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except fsio.UnsafeFileError as e:  # a directory, a FIFO, a device
        raise ConfigError(str(e)) from None
    except OSError as e:  # a symlink loop, no permission, an I/O error
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to be a config") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


# --- presets ---------------------------------------------------------------------------------------------------

PRESETS: dict[str, ModelConfig] = {
    # Every code path on a model that runs in milliseconds: sliding and full layers with different head dims and
    # kv-head counts, partial RoPE, MoE with top-2 of 8, a window (8) shorter than the canvas (16).
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=48, num_global_key_value_heads=1,
        layer_types=(SLIDING, FULL, SLIDING, FULL), sliding_window=8, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, canvas_length=16, max_position_embeddings=4096,
    ),
    # The released google/diffusiongemma-26B-A4B-it text geometry (spec section 1.4).
    "diffusiongemma-26b-a4b": ModelConfig(
        hidden_size=2816, intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8,
        num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        max_position_embeddings=262_144,
    ),
    # DiffusionGemma scaled down to train on a laptop CPU: the `dg` architecture (dense MLP beside 8 experts top-2,
    # sliding/full 2:1 with K=V and partial RoPE on full layers, self-conditioning MLP) at hidden 256, 6 layers, a
    # 32-token canvas, and the 8,192-id BPE that `dgemma data prepare` trains by default. 10,282,544 parameters
    # (6,743,600 active per token).
    "cpu-small": ModelConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL), sliding_window=64, num_experts=8,
        top_k_experts=2, moe_intermediate_size=128, canvas_length=32, max_position_embeddings=4096,
    ),
    # `dgemma demo`'s model: the `dg` architecture small enough to train on ~300k tokens in three minutes on one CPU
    # core (hidden 128, 4 layers, sliding/full 1:1, 8 experts top-2), an 8,192-id BPE (on Shakespeare alone most
    # words are one token) and a 16-token canvas.
    "cpu-tiny": ModelConfig(
        vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        layer_types=(SLIDING, FULL, SLIDING, FULL), sliding_window=64, num_experts=8, top_k_experts=2,
        moe_intermediate_size=64, canvas_length=16, max_position_embeddings=4096,
    ),
    # The `dg` architecture at the size of seed 003's Lite, for one GPU: hidden 1024, 24 layers (5 sliding : 1 full),
    # GQA 16/4 with head_dim 64 (128 and 2 kv heads on full layers), dense MLP 1408 beside 16 experts top-4 of width
    # 128, the GPT-2 vocabulary, canvas 256. 381,442,944 parameters, 268,196,736 active per token.
    "dg-380m": ModelConfig(
        vocab_size=50_257, hidden_size=1024, intermediate_size=1408, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=2,
        sliding_window=1024,
        num_experts=16, top_k_experts=4, moe_intermediate_size=128, canvas_length=256,
        max_position_embeddings=8192, pad_token_id=None, eos_token_id=50_256, bos_token_id=None,
    ),
    # Seed 003's DiffusionGemma-Lite on the dgemma block: dense, GQA 16/4, head_dim 64, full attention, tied GPT-2
    # vocabulary, per-canvas time embedding, zero-init linear self-conditioning, canvas 256. 342,284,288 parameters
    # (the seed states 343,516,160 for its block, which differs in norms; `dgemma inspect` prints ours).
    "lite-380m": ModelConfig(
        vocab_size=50_257, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, global_head_dim=64, num_global_key_value_heads=4,
        layer_types=(FULL,) * 24, sliding_window=4096, full_rope=RopeConfig("default", 10_000.0), num_experts=0,
        canvas_length=256, max_position_embeddings=8192, attention_k_eq_v=False, self_conditioning="linear",
        time_embedding=True,
        pad_token_id=None, eos_token_id=50_256, bos_token_id=None,
    ),
    # The Lite architecture at test size.
    "lite-tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, num_global_key_value_heads=2,
        layer_types=(FULL, FULL), sliding_window=256, full_rope=RopeConfig("default", 10_000.0), num_experts=0,
        canvas_length=16, max_position_embeddings=1024, attention_k_eq_v=False, self_conditioning="linear",
        time_embedding=True,
    ),
    # `dgemma bench` on a CPU (issue 7): the DiffusionGemma block with a 32k vocabulary, so the head, the
    # self-conditioning product and the sampler weigh what they weigh at scale; 32 experts top-4 (a 128-token canvas
    # touches nearly all of them), 5 sliding : 1 full layers with a window (64) shorter than the bench prompt (96).
    "bench-small": ModelConfig(
        vocab_size=32_768, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=64,
        num_experts=32, top_k_experts=4, moe_intermediate_size=128, canvas_length=128, max_position_embeddings=4096,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None


__all__ = [
    "FULL",
    "PRESETS",
    "SLIDING",
    "ConfigError",
    "ModelConfig",
    "RopeConfig",
    "default_layer_types",
    "preset",
    "read_json",
]
