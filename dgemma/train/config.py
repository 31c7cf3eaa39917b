"""A training run's recipe: `TrainConfig` (one frozen, validated dataclass: every field a `dgemma train` flag, saved as
train_config.json in each checkpoint), the presets of `TRAIN_PRESETS`, the learning-rate schedule, which fields
a resumed run may change, and what a step of it needs in memory (`estimate_memory`, `preflight`: the recipe's terms
in dgemma/model/costs.py's accounting). The loop that runs it is train/loop.py."""


from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dgemma.io.system import available_memory
from dgemma.model import costs
from dgemma.model.attention import IMPLS
from dgemma.model.config import PRESETS, ConfigError, ModelConfig, read_json, setting
from dgemma.sampling.generation_config import SEED_RANGE, is_seed
from dgemma.train.diffusion import LOSS_WEIGHTING, OBJECTIVES, T_SAMPLING, TIME
from dgemma.train.distill import teacher_problem
from dgemma.train.distributed import PARALLEL
from dgemma.weights import lora
from dgemma.weights.checkpoint import resolve_model_dir

CONFIG_JSON = "train_config.json"
# TrainConfig.preset's default, as a constant: on a slots=True dataclass `TrainConfig.preset` is a member descriptor.
DEFAULT_PRESET = "cpu-small"
EVAL_SEED = 20_240_601  # held-out noise is the same for every run and every evaluation, so val losses compare
# Fields a resumed run may change: they decide how long and how observably it trains, not what a step computes.
RESUMABLE = ("max_steps", "eval_every", "eval_batches", "eval_nelbo_steps", "eval_t_samples", "save_every",
             "keep_last", "log_every", "compile", "device", "parallel", "ep_size",
             "activation_checkpointing")
# recipe switches of the diffusion objectives
DIFFUSION_ONLY = ("diffusion_time", "t_sampling", "loss_weighting", "time_embedding", "observed_likelihood")


MAX_GRAD_ACCUM = 2**16  # micro-batches per optimizer step: 64x more than a 26B recipe's 1,024 at micro-batch 1


def posterior_objective(objective: str | None) -> str:
    """The training forward whose posterior a run of `objective` learned, which its bounds and x0 cross-entropy read:
    a distillation student and a chat fine-tune train the clean-context forward (`train/distill.py`,
    `train/diffusion.py:sft_loss`); a checkpoint without a train config is read as clean-context."""
    return "clean-context" if objective in (None, "sft", "distill") else objective


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything a training run needs besides its data and output paths; the defaults are the cpu-small recipe.
    `dgemma train` builds one flag per field."""

    preset: str = setting("model preset (dgemma.model.config.PRESETS)", default=DEFAULT_PRESET, metavar="PRESET")
    vocab_size: int | None = setting("override the preset's vocabulary size (default: the preset's)", default=None)
    canvas_length: int | None = setting("override the preset's canvas length L, the tokens denoised together "
                                        "(default: the preset's)", default=None)
    objective: str = setting("training objective (sft: chats, with init_from; distill: a few-step student of a "
                             "teacher, `dgemma distill`)", default="clean-context",
                             choices=(*OBJECTIVES, "sft", "distill"))
    teacher: str | None = setting("the frozen teacher of --objective distill: a diffusion run (its newest "
                                  "checkpoint) or checkpoint directory", default=None, metavar="RUN_OR_CHECKPOINT")
    student_steps: int | None = setting("--objective distill: the student's denoising steps N (its "
                                        "generation_config's max_denoising_steps); each training step matches two "
                                        "teacher steps of 1/(2N), so N is fewer than the teacher's steps", default=None)
    teacher_draws: int = setting("--objective distill: independent teacher two-step outcomes per noisy canvas; the "
                                 "target is the mean of their posteriors (the same minimiser as one draw, a K times "
                                 "smaller draw variance, K - 1 more teacher forwards a step)", default=1)
    init_from: str | None = setting("start from this checkpoint (HF layout, or a run) instead of random weights; its "
                                    "geometry replaces the preset's", default=None, metavar="DIR")
    lora_rank: int = setting("LoRA rank: train adapters on the init_from weights, frozen (0: train every weight)",
                             default=0)
    lora_alpha: float = setting("LoRA alpha: the update B A is scaled by alpha / rank", default=16.0)
    lora_targets: str = setting("what LoRA adapts", default="attention", choices=tuple(lora.TARGETS))
    seq_len: int = setting("tokens per training window (a whole number of canvases)", default=128)
    batch_size: int = setting("windows per micro-batch", default=4)
    grad_accum: int = setting("micro-batches per optimizer step", default=1)
    lr: float = setting("peak learning rate", default=3e-3)
    min_lr: float = setting("learning rate at the end of the cosine", default=3e-4)
    warmup_steps: int = setting("linear warm-up steps", default=20)
    max_steps: int = setting("optimizer steps in the whole run", default=3000)
    weight_decay: float = setting("AdamW decoupled weight decay (matrices only)", default=0.1)
    beta1: float = setting("AdamW beta1", default=0.9)
    beta2: float = setting("AdamW beta2", default=0.95)
    clip: float = setting("gradient-norm clip (0: off)", default=1.0)
    eval_every: int = setting("steps between held-out evaluations", default=50)
    eval_batches: int = setting("held-out micro-batches per evaluation", default=4)
    eval_nelbo_steps: int | None = setting("T of the held-out NELBO logged at each evaluation of a diffusion run "
                                           "(default: num_steps; 0: none); a continuous-time run logs the "
                                           "continuous-time bound beside it", default=None)
    eval_t_samples: int = setting("stratified t samples per canvas of that NELBO", default=4)
    save_every: int = setting("steps between checkpoints", default=100)
    keep_last: int = setting("checkpoints kept (older ones are deleted)", default=2)
    log_every: int = setting("steps between console lines when stdout is not a terminal", default=10)
    seed: int = setting("seed of the initial weights, the data order and every noise draw", default=0)
    num_steps: int = setting("diffusion steps T of the noise schedule (discrete time), and of the discrete bound "
                             "logged beside the continuous one", default=16)
    diffusion_time: str = setting("noise levels: discrete (t/T, t in 1..T, as DiffusionGemma) or continuous "
                                  "(anywhere in (0, 1], the T -> infinity chain, with a continuous-time bound)",
                                  default="discrete", choices=TIME)
    t_sampling: str = setting("noise levels of a micro-batch's canvases: independent draws, or a stratified "
                              "(low-discrepancy) set", default="uniform", choices=T_SAMPLING)
    loss_weighting: str = setting("x0: plain cross-entropy of the x0 prediction at every level; elbo: each level "
                                  "weighted as in the NELBO (the bound `dgemma eval` reports)", default="x0",
                                  choices=LOSS_WEIGHTING)
    time_embedding: bool | None = setting("time conditioning: add an embedding of the canvas's noise level t/T to its "
                                          "tokens (default: the preset's, or init_from's; on an init_from checkpoint "
                                          "without it, its projection starts at zero; a dg checkpoint with it does not "
                                          "load in transformers)", default=None)
    observed_likelihood: bool | None = setting("the posterior p(x0 | x_s) multiplies the network's prediction by the "
                                               "likelihood q(x_s | x0) of each token's own observation (exact Bayes; "
                                               "diffusion/noise.py), so a clean-looking token is near-certain at low "
                                               "noise (default: the preset's, or init_from's; such a checkpoint does "
                                               "not load in transformers)", default=None)
    self_conditioning_prob: float = setting("probability of the self-conditioning pre-pass", default=0.5)
    ar_weight: float = setting("weight of a next-token loss on the clean stream (clean-context)", default=0.0)
    chunk_rows: int = setting("rows of the (rows, V) logits alive at once in the loss", default=1024)
    impl: str = setting("attention implementation", default="fast", choices=IMPLS)
    dtype: str = setting("auto: bf16 autocast on CUDA, fp32 on CPU", default="auto",
                         choices=("auto", "float32", "bfloat16"))
    compile: bool = setting("torch.compile each block (CUDA only; never on CPU)", default=True)
    device: str = setting("auto: CUDA when available", default="auto", choices=("auto", "cpu", "cuda"))
    parallel: str = setting("under torchrun: ddp (a replica per rank), fsdp (FSDP2: parameters, gradients and AdamW "
                            "state sharded per block), ep (each rank holds 1/W of the routed experts; every rank "
                            "reads the same batch: one data replica), or ddp+ep / fsdp+ep (W / ep_size data replicas "
                            "of ep_size ranks that split the experts; docs/parallel.md)", default="ddp",
                            choices=PARALLEL)
    ep_size: int | None = setting("--parallel ddp+ep / fsdp+ep: the ranks that split the routed experts (it divides "
                                  "the world size; --parallel ep: every rank)", default=None)
    activation_checkpointing: bool = setting("recompute each block's activations in backward (less memory, about a "
                                             "third more compute)", default=False)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"TrainConfig.{name}: {msg}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices:
                check(getattr(self, f.name) in choices, f.name, f"must be one of {', '.join(choices)}")
        check(self.preset in PRESETS, "preset", f"must be one of {', '.join(sorted(PRESETS))}")
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "eval_t_samples",
                     "save_every", "keep_last", "log_every", "num_steps", "chunk_rows"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive int")
        # a typo's 2**64 micro-batches would be one optimizer step that never ends (nothing saved, no step logged)
        check(self.grad_accum <= MAX_GRAD_ACCUM, "grad_accum", f"must be at most {MAX_GRAD_ACCUM:,} micro-batches "
              "per optimizer step (raise --batch-size instead)")
        for name in ("vocab_size", "canvas_length"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), name,
                  "must be a positive int or None")
            check(self.init_from is None or v is None, name, "must be None with init_from (the checkpoint decides)")
        check(self.ep_size is None or (isinstance(self.ep_size, int) and not isinstance(self.ep_size, bool)
                                       and self.ep_size > 0), "ep_size", "must be a positive int or None")
        check(self.ep_size is None or self.parallel in ("ddp+ep", "fsdp+ep"), "ep_size",
              f"goes with parallel ddp+ep or fsdp+ep (ep: every rank), not {self.parallel}")
        check(is_seed(self.seed), "seed", f"must be {SEED_RANGE}")
        check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps", "must be an int >= 0")
        check(self.eval_nelbo_steps is None or (isinstance(self.eval_nelbo_steps, int)
                                                and not isinstance(self.eval_nelbo_steps, bool)
                                                and self.eval_nelbo_steps >= 0), "eval_nelbo_steps",
              "must be None or an int >= 0")
        for name in ("time_embedding", "observed_likelihood"):
            check(getattr(self, name) in (None, True, False), name, "must be true, false or None")
            check(self.init_from is None or getattr(self, name) is None or not self.lora_rank, name,
                  "must be None with LoRA (the adapter adapts the checkpoint's own model)")
        check(self.init_from is not None or (self.objective not in ("sft", "distill") and not self.lora_rank),
              "init_from", "must name a checkpoint for " + (f"--objective {self.objective}"
                                                             if self.objective in ("sft", "distill") else "LoRA"))
        distill = self.objective == "distill"
        check((self.teacher is not None) == distill, "teacher", "names the teacher of --objective distill, and only "
              "of it")
        check(self.student_steps is None if not distill else (isinstance(self.student_steps, int) and not
              isinstance(self.student_steps, bool) and self.student_steps >= 1), "student_steps",
              "must be an int >= 1 with --objective distill, and None without")
        check(isinstance(self.teacher_draws, int) and not isinstance(self.teacher_draws, bool)
              and self.teacher_draws >= 1 and (distill or self.teacher_draws == 1), "teacher_draws",
              "must be an int >= 1, and 1 without --objective distill")
        check(not distill or Path(self.teacher).exists(), "teacher",  # type: ignore[arg-type]
              "no such checkpoint or run directory")
        check(not (distill and self.lora_rank), "lora_rank", "must be 0 with --objective distill (the student "
              "trains every weight)")
        for f in dataclasses.fields(self):
            if f.type == "float":
                v = getattr(self, f.name)
                check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), f.name,
                      "must be a finite number")
        check(self.lr > 0, "lr", "must be > 0")
        check(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}]")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
        check(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
        check(self.clip >= 0, "clip", "must be >= 0")
        check(0 <= self.self_conditioning_prob <= 1, "self_conditioning_prob", "must be in [0, 1]")
        check(self.ar_weight >= 0, "ar_weight", "must be >= 0")
        for name in DIFFUSION_ONLY:
            check(self.objective in ("clean-context", "noisy-context") or getattr(self, name) == _DEFAULTS[name]
                  or (distill and name == "t_sampling"),
                  name, f"is a diffusion recipe switch: objective {self.objective!r} takes only the default")
        check(self.ar_weight == 0 or self.objective == "clean-context", "ar_weight",
              "is the clean stream's next-token loss: only the clean-context objective has one")
        mc = self.model_config
        if self.init_from is not None and self.time_embedding is False:
            check(not self.base_model_config.time_embedding, "time_embedding",
                  f"must not be false: init_from {self.init_from} is time-conditioned (its trained time input would "
                  "be dropped)")
        L = mc.canvas_length
        check(self.objective == "ar" or self.seq_len % L == 0, "seq_len",
              f"must be a multiple of the preset's canvas_length={L} for a diffusion objective")
        check(self.seq_len <= mc.max_position_embeddings, "seq_len",
              f"must be <= the preset's max_position_embeddings={mc.max_position_embeddings}")
        lora.check_adapter(self.lora_rank, self.lora_alpha, self.lora_targets, mc)  # the rank against layer widths
        if distill:  # the teacher last: it reads the teacher's files
            problem = teacher_problem(self.teacher, self.student_steps, mc)  # type: ignore[arg-type]
            check(problem is None, *(problem or ("teacher", "")))

    @property
    def nelbo_steps(self) -> int:
        """T of the held-out discrete-time NELBO of each evaluation (0: none): eval_nelbo_steps, by default the
        training T (`num_steps`; a distillation run's: `student_steps`), for continuous-time runs too (they log the
        continuous-time bound beside it)."""
        default = self.student_steps if self.objective == "distill" else self.num_steps
        return default if self.eval_nelbo_steps is None else self.eval_nelbo_steps  # type: ignore[return-value]

    @property
    def continuous_bound(self) -> bool:
        """Whether each evaluation logs the continuous-time NELBO (val_nelbo_continuous): continuous-time runs."""
        return self.objective in ("clean-context", "noisy-context") and self.diffusion_time == "continuous"

    @property
    def base_model_config(self) -> ModelConfig:
        """The model before this run's switches: init_from's (the checkpoint's geometry), or the preset's."""
        if self.init_from is not None:
            config = resolve_model_dir(self.init_from) / "config.json"
            return ModelConfig.from_hf(read_json(config), source=str(config))
        return PRESETS[self.preset]

    @property
    def model_config(self) -> ModelConfig:
        """The model this run trains: `base_model_config` with the switches set here. With init_from only the
        diffusion switches (time_embedding, observed_likelihood) may change it: an AR checkpoint becomes a
        diffusion model's starting point (docs/training.md, "From an AR checkpoint")."""
        mc = self.base_model_config
        names = ("vocab_size", "canvas_length", "time_embedding", "observed_likelihood") if self.init_from is None \
            else ("time_embedding", "observed_likelihood")
        overrides = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return mc.replace(**overrides) if overrides else mc

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def with_objective(self, objective: str, **changes: Any) -> TrainConfig:
        """This recipe with another objective (and `changes`, applied together: a distill recipe is valid only with
        its teacher); the diffusion-only switches go back to their defaults for `ar` and `sft` (the AR baseline of a
        diffusion recipe: the same backbone, data, batch and schedule), and for `distill` (the student's model is its
        teacher's, switches included; its levels are the student's grid)."""
        if objective in ("ar", "sft", "distill"):
            changes = {k: _DEFAULTS[k] for k in DIFFUSION_ONLY} | changes
        return self.replace(objective=objective, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = CONFIG_JSON) -> TrainConfig:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"{source}: unknown TrainConfig field(s) {', '.join(unknown)}")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}

# Training recipes per model preset, so that `dgemma train --preset NAME` needs no other flag.
TRAIN_PRESETS: dict[str, TrainConfig] = {
    # Seconds per step on a CPU: the test recipe.
    "tiny": TrainConfig(preset="tiny", seq_len=32, batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=10,
                        max_steps=200, eval_every=20, save_every=50, log_every=10, chunk_rows=256),
    # Laptop-sized: 10M parameters, 512 tokens a step (4 canvases of 32 a window), a high learning rate, 1.5M tokens
    # in all. The diffusion recipe is the best measured (docs/training.md, "Continuous time and the observed
    # likelihood" and "What the recipe options are worth"): time conditioning and levels anywhere in (0, 1]
    # (continuous time), with the plain x0 loss. Its checkpoints do not load in transformers, whose DiffusionGemma
    # has no time input.
    "cpu-small": TrainConfig(time_embedding=True, diffusion_time="continuous"),
    # Seed 003's single-GPU recipe: 8 x 2048 tokens x 4 micro-batches = 65k tokens a step, ~4B tokens in all.
    "dg-380m": TrainConfig(preset="dg-380m", seq_len=2048, batch_size=8, grad_accum=4, lr=3e-4, min_lr=3e-5,
                           warmup_steps=2000, max_steps=60_000, eval_every=1000, eval_batches=20, save_every=1000,
                           keep_last=3, log_every=50, chunk_rows=8192),
}
# Seed 003's Lite on the same recipe, so the two architectures compare like with like.
TRAIN_PRESETS["lite-380m"] = TRAIN_PRESETS["dg-380m"].replace(preset="lite-380m")


def train_preset(name: str) -> TrainConfig:
    """The recipe for a model preset: TRAIN_PRESETS[name], or the defaults with that preset."""
    return TRAIN_PRESETS[name] if name in TRAIN_PRESETS else TrainConfig(preset=name)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then a cosine down to `min_lr` at `max_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# --- the memory pre-flight of a training step -------------------------------------------------------------------------

def estimate_memory(cfg: TrainConfig, device_type: str = "cpu", use_bf16: bool = False, shards: int = 1,
                    ep: int = 1) -> dict[str, int]:
    """Peak bytes of one training step of `cfg` on one rank, by part (`costs.training_step_bytes`: parameters,
    gradients, AdamW state, activations, the saved attention masks, the loss logits). Blocks are compiled on CUDA when
    `cfg.compile`; the reference attention keeps its scores; `shards`: the ranks FSDP shards over; `ep`: the ranks
    that split the routed experts."""
    parts = costs.training_step_bytes(
        cfg.model_config, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        paired=cfg.objective in ("clean-context", "sft", "distill"), chunk_rows=cfg.chunk_rows, use_bf16=use_bf16,
        compiled=cfg.compile and device_type == "cuda", eager_scores=cfg.impl == "reference",
        activation_checkpointing=cfg.activation_checkpointing, lora=bool(cfg.lora_rank), shards=shards, ep=ep)
    if cfg.objective == "distill":  # the frozen teacher: the student's architecture, whole on every rank, fp32
        parts["teacher"] = 4 * costs.parameter_counts(cfg.model_config)["total"]
    return parts


def preflight(cfg: TrainConfig, device: torch.device, use_bf16: bool, shards: int = 1, ep: int = 1) -> str:
    """Refuse (ValueError) a configuration whose estimated peak memory exceeds what is free, naming the flags that
    lower it; else a summary line."""
    parts = estimate_memory(cfg, device.type, use_bf16, shards, ep)
    need, free = sum(parts.values()), available_memory(device)
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    if free is not None and need > free:
        raise ValueError(f"estimated peak memory {gib(need)} ({detail}) exceeds the {gib(free)} available on "
                         f"{device.type}; lower --batch-size or --seq-len (raise --grad-accum to keep the tokens "
                         f"per step), lower --chunk-rows, or pick a smaller preset")
    return f"memory: estimated peak {gib(need)} of {gib(free) if free is not None else 'unknown'} available"
