"""Training from scratch: `train(TrainConfig, data_dir, out_dir)`, one process, or one rank of a torchrun job (the
`dist` argument, dgemma/train/distributed.py: the same loop, with each micro-batch split across the ranks). The same
loop fine-tunes a checkpoint (`init_from`): on token shards, or with `objective="sft"` on a chat JSONL file
(dgemma/data/sft.py packs it, `train/diffusion.py:sft_loss` scores the answers), every weight or LoRA adapters
(`lora_rank`, dgemma/weights/lora.py).

    for step in range(start, max_steps):
        lr = warmup then cosine
        for each of grad_accum micro-batches:        data replayed from its index; a generator per micro-step
            loss = training_loss(model, x0, ...)     dgemma/train/diffusion.py: clean-context | noisy-context | ar
                                                     (distill: train/distill.py, against a frozen teacher)
            (loss / grad_accum).backward()
        clip; skip the step if the loss or the gradient is not finite; AdamW
        held-out loss every eval_every steps; checkpoint every save_every steps (and at the end)

Bit-exact resume: every random draw of micro-step m comes from a generator seeded with seed * 1_000_003 + m, and
micro-batch m is batch m of the dataset's deterministic order, so a run restarted from its checkpoint at step s
replays exactly what an uninterrupted run does (parameters bit-identical on CPU in fp32). A step skipped for a
non-finite loss still consumes its micro-batches and its learning-rate slot, so skips do not break this either.

Run directory:

    RUN/.lock, RUN/run.json             the writer's lock and the run's record (config, data fingerprint):
                                        dgemma/train/run_dir.py
    RUN/metrics.jsonl                   one JSON object per step, evaluation and skipped step
    RUN/tokenizer.json                  copied from the data, so `dgemma generate --model RUN` can read text
    RUN/checkpoints/step-0000200/       config.json, generation_config.json, model.safetensors (the Hugging Face
                                        layout, fp32), tokenizer.json, train_config.json, trainer_state.pt
    RUN/checkpoints/latest              the name of the newest complete checkpoint, written last
    (with several ranks, checkpoints are torch.distributed.checkpoint shards: dgemma/train/distributed.py)

A checkpoint is written into a hidden temporary directory and renamed into place, so a `step-*` directory is always
complete, whenever the process dies. One process at a time writes a run (dgemma/train/run_dir.py's lock); a non-finite
loss or gradient on the first NONFINITE_FIRST_STEPS steps, or on NONFINITE_STREAK steps in a row, stops the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from dgemma.data.sft import ChatData
from dgemma.data.shards import TokenDataset, check_token_range, sha256_file, verify
from dgemma.data.templates import load_chat_template
from dgemma.data.tokenizer import check_vocab, load_tokenizer
from dgemma.diffusion.likelihood import nelbo_per_window
from dgemma.io import fsio, lock
from dgemma.io.console import Console, Eta, duration
from dgemma.model.config import ConfigError, ModelConfig
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.train import distributed, expert_parallel, run_dir
from dgemma.train.config import (
    CONFIG_JSON,
    EVAL_SEED,
    RESUMABLE,
    TrainConfig,
    learning_rate,
    posterior_objective,
    preflight,
)
from dgemma.train.diffusion import LossOutput, sft_loss, training_loss
from dgemma.train.distill import distill_loss
from dgemma.train.distributed import Dist, checkpoint_world_size, load_into, resolve_device, shared
from dgemma.train.heldout import window_cross_entropy
from dgemma.train.run_dir import NonFiniteError
from dgemma.weights import lora
from dgemma.weights.checkpoint import resolve_model_dir
from dgemma.weights.loading import init_weights, load_generation_config, load_model

# A non-finite loss or gradient norm on one of the first NONFINITE_FIRST_STEPS steps of a run, or on NONFINITE_STREAK
# steps in a row later, stops training (NonFiniteError); a lone one later is skipped (the NaN guard).
NONFINITE_FIRST_STEPS, NONFINITE_STREAK = 3, 5


def micro_step_generator(cfg: TrainConfig, micro_step: int, device: torch.device) -> torch.Generator:
    """The only source of randomness of micro-step `micro_step` (noise levels, corruption, self-conditioning)."""
    return torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + micro_step) % 2**64)  # 64-bit seeds


def make_optimizer(model: DiffusionGemma, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (projections, experts, the tied embedding/head, as nanoGPT does).
    1-D parameters (norm scales, the router's scales) are gains whose init is 1: decay would pull them to 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


# --- checkpoints ---------------------------------------------------------------------------------------------------

def check_resumable(saved: TrainConfig, cfg: TrainConfig, where: Path, saved_world: int = 1, world: int = 1
                    ) -> None:
    """A resumed run must compute the same steps: only the RESUMABLE fields may differ. On another number of ranks,
    batch_size and grad_accum may change as long as the windows per step (batch x grad_accum x ranks) do not."""
    split = ("batch_size", "grad_accum") if saved_world != world else ()
    diff = [f"{f.name} {getattr(saved, f.name)!r} -> {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
            if f.name not in RESUMABLE + split and getattr(saved, f.name) != getattr(cfg, f.name)]
    before, now = distributed.windows_per_step(saved, saved_world), distributed.windows_per_step(cfg, world)
    if before != now:
        diff.append(f"windows per step (batch_size x grad_accum x ranks) {saved.batch_size} x {saved.grad_accum} x "
                    f"{saved_world} = {before} -> {cfg.batch_size} x {cfg.grad_accum} x {world} = {now}")
    if diff:
        raise ConfigError(f"cannot resume {where}: its config differs in {'; '.join(diff)} (only "
                          f"{', '.join(RESUMABLE)} may change; start a new run for the rest)")


# --- the loop ------------------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    train_loss: float | None
    val_loss: float | None
    tokens_per_s: float
    stopped: str  # "max_steps", "until_step", "time" or "interrupt"


@torch.no_grad()
def heldout_metrics(net: torch.nn.Module, val: Any, cfg: TrainConfig, device: torch.device, use_bf16: bool,
             dist: Dist | None = None) -> dict[str, float]:
    """Held-out measures on the first `eval_batches` validation micro-batches, with fixed noise and no
    self-conditioning, as a dict for metrics.jsonl:

        val_loss, val_loss_se     the objective's loss (the x0 cross-entropy of a diffusion run: seed 003's held-out
                                  measure; the next-token cross-entropy of an AR run), its SE across micro-batches
        val_nelbo, val_nelbo_se   diffusion runs with nelbo_steps > 0: the NELBO (dgemma/diffusion/likelihood.py) at
                                  T = nelbo_steps (default: the training T of a discrete-time run) with
                                  eval_t_samples stratified t per canvas, an upper bound on the held-out NLL that
                                  compares with the AR run's val_loss; SE across windows
        val_nelbo_continuous(_se) continuous-time runs: the continuous-time bound, eval_t_samples stratified levels

    `net` is `Dist.wrap`'s module (its forward is the loss). With several ranks a micro-batch is the global one, its
    rows split across the ranks, and the sums reduced, so every rank gets the same numbers."""
    d = dist or Dist(device=device)
    shift = 1 if cfg.objective == "ar" else 0
    diffusion = cfg.objective in ("clean-context", "noisy-context", "distill")
    bounds = {"val_nelbo": cfg.nelbo_steps if diffusion else 0, "val_nelbo_continuous": cfg.continuous_bound}
    bounds = {k: (None if v is True else v) for k, v in bounds.items() if v}  # name -> T (None: continuous time)
    # sums over micro-batches of (loss, loss^2, count, loss x tokens, tokens); per bound, over windows of
    # (nelbo/token, its square, count)
    sums = [0.0] * (5 + 3 * len(bounds))
    for i, x0 in enumerate(val.heldout_batches(cfg.batch_size * d.data_world, cfg.seq_len, shift=shift)):
        if i == cfg.eval_batches:
            break
        rows = x0.shape[0]
        lo, hi = d.data_rank * rows // d.data_world, (d.data_rank + 1) * rows // d.data_world
        empty = lo == hi  # a last batch with fewer rows than ranks: every rank still runs the forward (FSDP gathers
        lo, hi = (rows - 1, rows) if empty else (lo, hi)  # in it) on a stand-in row that is not counted
        rows_kw = {"batch_rows": None if d.data_world == 1 else (lo, rows)}
        per_window = []
        with torch.autocast(device.type, torch.bfloat16, enabled=use_bf16):
            g = torch.Generator(device=device).manual_seed(EVAL_SEED + i)
            if cfg.objective == "sft":  # chats: the fine-tuning loss
                _, out = net(x0[lo:hi].to(device), objective=cfg.objective, num_steps=cfg.num_steps,
                             self_conditioning_prob=0.0, chunk_rows=cfg.chunk_rows, generator=g, **rows_kw)
                loss, tokens = float(out.cross_entropy), out.tokens
            elif cfg.objective == "distill":  # the distillation KL itself, with fixed noise and no self-conditioning
                _, out = net(x0[lo:hi].to(device), objective=cfg.objective, num_steps=cfg.student_steps,
                             self_conditioning_prob=0.0, chunk_rows=cfg.chunk_rows, generator=g, **rows_kw)
                loss, tokens = float(out.loss), out.tokens
            else:  # token windows: the held-out cross-entropy `dgemma eval` computes too
                time = {"time": cfg.diffusion_time} if diffusion else {}
                nats, tokens = net(x0[lo:hi].to(device), measure=window_cross_entropy, objective=cfg.objective,
                                   num_steps=cfg.num_steps, generator=g, **time, **rows_kw)[0]
                loss = float(nats) / tokens
            for T in bounds.values():
                g = torch.Generator(device=device).manual_seed(EVAL_SEED + i)
                per_window.append(net(x0[lo:hi].to(device), measure=nelbo_per_window, generator=g,
                                      objective=posterior_objective(cfg.objective),
                                      num_steps=T,
                                      num_t_samples=cfg.eval_t_samples if T is None else min(cfg.eval_t_samples, T))[0])
        if tokens and not empty:
            sums[0:3] = sums[0] + loss, sums[1] + loss * loss, sums[2] + 1  # the batch's mean, one unit of SE
            sums[3] += loss * tokens
            sums[4] += tokens
            for b, values in enumerate(per_window):
                per_token = values.double() / x0.shape[1]
                k = 5 + 3 * b
                sums[k:k + 3] = (sums[k] + float(per_token.sum()), sums[k + 1] + float((per_token ** 2).sum()),
                                 sums[k + 2] + per_token.numel())
    # the ranks of an expert-parallel group measured the same rows: each counts for 1/ep of them
    sums = d.sum([s / d.layout.ep for s in sums])
    if sums[4] == 0:
        raise ValueError("the validation split has no complete window of seq_len tokens")
    result = {"val_loss": sums[3] / sums[4], "val_loss_se": _se(*sums[0:3])}
    for b, name in enumerate(bounds):
        k = 5 + 3 * b
        result.update({name: sums[k] / sums[k + 2], f"{name}_se": _se(*sums[k:k + 3])})
    return result


def _se(total: float, squares: float, n: float) -> float:
    """Standard error of a mean from the sum, the sum of squares and the count (nan below 2)."""
    if n < 2:
        return math.nan
    var = max(0.0, (squares - total * total / n) / (n - 1))
    return math.sqrt(var / n)


def batch_loss(model: DiffusionGemma, batch: Any, *, objective: str, ar_weight: float = 0.0,
               teacher: DiffusionGemma | None = None, **kw: Any) -> LossOutput:
    """The objective's loss on one micro-batch (the loss `Dist.wrap` runs): token windows
    (train/diffusion.py:training_loss), packed chats (train/diffusion.py:sft_loss, which has no next-token term), or
    a student against its frozen `teacher` (train/distill.py:distill_loss, `num_steps` the student's).
    Held-out measures that are no training loss (the NELBO) run through `LossModule`'s `measure`."""
    if objective == "sft":
        return sft_loss(model, batch, **kw)
    if objective == "distill":
        assert teacher is not None, "the distill objective needs its teacher"
        kw = {k: v for k, v in kw.items() if k not in ("loss_weighting", "time")}
        return distill_loss(model, batch, teacher=teacher, **kw)
    return training_loss(model, batch, objective=objective, ar_weight=ar_weight, **kw)


def open_chats(cfg: TrainConfig, data: Path) -> tuple[ChatData, ChatData, dict[str, Any]]:
    """The chat JSONL file of an sft run as (training batches, held-out batches, the data's fingerprint), rendered
    with init_from's tokenizer and chat template; the held-out loss is that of the file's first eval_batches batches
    in file order (fixed noise)."""
    mc = cfg.model_config
    if not data.is_file():
        raise FileNotFoundError(f"{data}: no such chat file (JSONL, one {{\"messages\": [...]}} per line)")
    base = resolve_model_dir(cfg.init_from)  # type: ignore[arg-type]
    if not (base / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{base} has no tokenizer.json: fine-tuning renders the chats with the checkpoint's "
                                "tokenizer and chat template")
    tokenizer = load_tokenizer(base)
    check_vocab(tokenizer, mc)
    chats = ChatData(data, tokenizer, load_chat_template(base), canvas_length=mc.canvas_length, seq_len=cfg.seq_len,
                     max_positions=mc.max_position_embeddings,
                     pad_id=mc.pad_token_id if mc.pad_token_id is not None else 0, model_dir=base)
    return chats, chats, chats.fingerprint(sha256_file(base / "tokenizer.json"))


def train(cfg: TrainConfig, data_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
          resume: bool = False, allow_new_data: bool = False, max_minutes: float | None = None,
          until_step: int | None = None, stream: TextIO | None = None, dist: Dist | None = None) -> TrainResult:
    """Train (or, with `resume`, continue) the run in `out_dir` on the shards in `data_dir`, up to `cfg.max_steps`, or
    to `until_step` (the schedule still spans max_steps), or for `max_minutes`; it checkpoints where it stops. With
    `resume`, a run with no checkpoint yet (or no directory) starts at step 0, so one command line serves the first
    start and every restart. Every input problem raises (ConfigError, ValueError, FileNotFoundError) before `out_dir`
    is touched; the run is written under its lock (lock.BusyError if another process holds it).

    `dist` (dgemma/train/distributed.py, `Dist.from_env()` under torchrun) makes this call one rank of a job: every rank
    runs this function; rank 0 alone checks and writes the run directory (lock, run.json, metrics, console) and every
    check is agreed on, so a failure on any rank stops them all. None: a single process."""
    d = dist or Dist(device=resolve_device(cfg.device))
    d.parallel, d.ep_size = cfg.parallel, cfg.ep_size  # ep: the ranks of a group read the same rows (d.data_world)
    if cfg.lora_rank and d.world_size > 1:
        raise ConfigError(f"TrainConfig.lora_rank: LoRA trains in one process ({d.world_size} ranks here); several "
                          "ranks are not supported yet")
    console = Console((stream or sys.stdout) if d.is_main else io.StringIO(), cfg.log_every)
    run, data_dir, device = Path(out_dir), Path(data_dir), d.device
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    mc = cfg.model_config
    if d.world_size > 1:  # the (data, ep) mesh, before anything is written (the same error on every rank)
        d.symmetric(lambda: expert_parallel.check(mc, cfg.parallel, d.world_size, cfg.ep_size))

    def check_data() -> tuple[Any, Any, dict[str, Any]]:
        if use_bf16 and device.type != "cuda":
            raise ValueError("TrainConfig.dtype: bfloat16 autocast is for CUDA; train in float32 on the CPU")
        if cfg.objective == "sft":
            if d.is_main:
                lock.check_unlocked(run)
            return open_chats(cfg, data_dir)
        if not data_dir.is_dir():
            raise FileNotFoundError(f"{data_dir}: no such data directory (prepare one with `dgemma data prepare`)")
        train_set, val_set = TokenDataset(data_dir, split="train"), TokenDataset(data_dir, split="val")
        check_vocab(train_set.tokenizer(), mc)
        if d.is_main:
            lock.check_unlocked(run)
        if d.local_rank == 0:  # one rank per node reads every shard
            verify(data_dir, train_set.meta)  # checksums, then ids < vocab: a damaged shard is one error naming it
            check_token_range(data_dir, mc.vocab_size, train_set.meta)
        return train_set, val_set, run_dir.data_fingerprint(train_set.meta)

    train_set, val_set, fingerprint = d.agree(check_data)
    d.same_everywhere("the data's fingerprint (meta.json's shard checksums, the tokenizer)", fingerprint)

    def check_config(saved: dict[str, Any], source: Path) -> None:
        record = run_dir.read_record(run) or {}
        check_resumable(TrainConfig.from_json(saved, str(source)), cfg, run, distributed.recorded_data_world(record),
                        d.data_world)

    d.on_main(lambda: run_dir.check_writable(run, resume, fingerprint, allow_new_data, data_dir, check_config))
    shards = d.world_size if d.sharded else 1  # fsdp, fsdp+ep (the split experts aside)
    console.print(d.agree(lambda: preflight(cfg, device, use_bf16, shards, d.layout.ep)))
    if d.world_size > 1:
        console.print(f"{d.world_size} ranks ({cfg.parallel}, {'nccl' if device.type == 'cuda' else 'gloo'}): "
                      f"{cfg.batch_size} windows a rank x {d.data_world} x {cfg.grad_accum} micro-batches a step")

    # Nothing above wrote anything; from here on the run directory is ours, and the checks are redone under its lock.
    with contextlib.ExitStack() as held:
        def take_run() -> None:
            held.enter_context(lock.locked(run))
            record = run_dir.check_writable(run, resume, fingerprint, allow_new_data, data_dir, check_config)
            change = record and "data" in record and run_dir.describe_data_change(record["data"], fingerprint)
            if change:
                console.print(f"warning: {run} continues on other data ({change}): --allow-new-data")
            # a resume keeps what the run first inherited (its init_from checkpoint may be gone by now)
            start = record["inherited"] if record and "inherited" in record else run_dir.inherited(cfg.init_from)
            teacher = {}
            if cfg.teacher is not None:  # the checkpoint that taught the first start: a resume names a change
                now = str(resolve_model_dir(cfg.teacher))
                teacher = {"teacher_checkpoint": record.get("teacher_checkpoint", now) if record else now}
                if teacher["teacher_checkpoint"] != now:
                    console.print(f"warning: the teacher {cfg.teacher} is now {now}, not "
                                  f"{teacher['teacher_checkpoint']} as when this run started: the resume is not "
                                  "bit-exact (give --teacher a checkpoint directory to pin it)")
            run_dir.write_record(run, {"train_config": cfg.to_json(), "data": fingerprint, "data_dir": str(data_dir),
                                       "world_size": d.world_size, "data_world": d.data_world}
                                | ({"inherited": start} if start else {}) | teacher)
            run_dir.clean_temporaries(run)

        d.on_main(take_run)
        return _train_locked(cfg, run, train_set, val_set, d, use_bf16, console, max_minutes, until_step)


def _load_checkpoint(ckpt: Path, cfg: TrainConfig, model: DiffusionGemma, optimizer: torch.optim.Optimizer,
                     d: Dist) -> dict[str, Any]:
    """Load a checkpoint into `model` and `optimizer` and return its trainer state, or raise if any part is damaged
    or its config is not this run's (run_dir.newest_intact tries the next older one)."""
    check_resumable(TrainConfig.from_json(json.loads((ckpt / CONFIG_JSON).read_text()), str(ckpt / CONFIG_JSON)),
                    cfg, ckpt, checkpoint_world_size(ckpt), d.data_world)
    return load_into(d, ckpt, model, optimizer,
                     read_weights=(lambda p: lora.read_weights(model, p)) if cfg.lora_rank else None)


def initial_model(cfg: TrainConfig, device: torch.device) -> DiffusionGemma:
    """Step 0's model: random weights (seeded), or init_from's weights, with fresh LoRA adapters (A drawn from the
    seed, B zero) when lora_rank > 0."""
    if cfg.init_from is None:
        return init_weights(DiffusionGemma(cfg.model_config, impl=cfg.impl), seed=cfg.seed).to(device)
    model = load_model(cfg.init_from, dtype=torch.float32, device=device, impl=cfg.impl)
    if cfg.model_config != model.config:  # the diffusion switches on another model's weights
        model = with_diffusion_switches(model, cfg.model_config, device)
    if cfg.lora_rank:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            lora.attach(model, adapter_config(cfg))
    return model


def with_diffusion_switches(model: DiffusionGemma, config: ModelConfig, device: torch.device) -> DiffusionGemma:
    """`model`'s weights in a model of `config`, which differs only in the diffusion switches (TrainConfig.model_config
    allows no other change on init_from): the observed likelihood has no weights; a new time input's projection starts
    at zero, so the step-0 model computes exactly what the checkpoint does (an AR baseline adapted to diffusion, as
    Dream and DiffuLLaMA adapt theirs; docs/training.md, "From an AR checkpoint")."""
    new = DiffusionGemma(config, impl=model.impl).to(device)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("time_proj" in k.split(".") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name in missing:
            new.get_parameter(name).zero_()
    return new


def generation_config(cfg: TrainConfig, eot_id: int) -> GenerationConfig:
    """The generation settings the run's checkpoints carry. Documents end with the data's end-of-text id `eot_id`
    (answers with the chat template's end of turn): generation stops there. A fine-tuned checkpoint keeps its sampler
    settings; a distilled student takes its teacher's with max_denoising_steps = student_steps."""
    mc = cfg.model_config
    if cfg.init_from is None:
        return GenerationConfig(eos_token_id=(eot_id,), pad_token_id=mc.pad_token_id, bos_token_id=mc.bos_token_id)
    if cfg.objective == "distill":  # the teacher's settings at the student's steps
        return load_generation_config(cfg.teacher).stopping_at(eot_id).replace(  # type: ignore[arg-type]
            max_denoising_steps=cfg.student_steps)
    gen = load_generation_config(cfg.init_from).stopping_at(eot_id)
    return gen if gen.pad_token_id is not None else gen.replace(pad_token_id=mc.pad_token_id)


def adapter_config(cfg: TrainConfig) -> Any:
    """The peft LoraConfig of a LoRA run (its base: init_from's resolved checkpoint directory)."""
    base = str(resolve_model_dir(cfg.init_from).resolve())  # type: ignore[arg-type]
    return lora.lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, base)


def _train_locked(cfg: TrainConfig, run: Path, train_set: TokenDataset, val_set: TokenDataset, d: Dist,
                  use_bf16: bool, console: Console, max_minutes: float | None, until_step: int | None) -> TrainResult:
    mc, device = cfg.model_config, d.device
    # The same on every rank; FSDP from a checkpoint: built on the meta device, each rank then fills only its shards
    # with what rank 0 alone reads (Dist.wrap's fill_from), so no rank holds the whole model.
    deferred = cfg.init_from is not None and d.world_size > 1 and cfg.parallel == "fsdp"
    if deferred and mc != cfg.base_model_config:
        raise ConfigError(f"--init-from {cfg.init_from} with new diffusion switches (time embedding, observed "
                          "likelihood) under --parallel fsdp: FSDP fills the checkpoint's own model; start the "
                          "diffusion run with ddp or one process, then continue it with fsdp")
    model = distributed.meta_model(cfg.init_from, cfg.impl) if deferred else initial_model(cfg, device)
    gen = generation_config(cfg, train_set.eot_id)  # what each checkpoint's generation_config.json holds
    write_weights = None
    if cfg.lora_rank:  # a LoRA checkpoint holds the adapter, not the frozen base
        adapter = adapter_config(cfg)
        write_weights = lambda path: lora.save_adapter(model, adapter, path, gen)
    model.train()
    loss_fn: Any = batch_loss
    if cfg.objective == "distill":  # the frozen teacher: whole on every rank, outside the wrapped module
        teacher = load_model(cfg.teacher, dtype=torch.float32, device=device, impl=cfg.impl)  # type: ignore[arg-type]
        loss_fn = functools.partial(batch_loss, teacher=teacher.eval().requires_grad_(False))
    net = d.wrap(model, loss_fn, parallel=cfg.parallel, use_bf16=use_bf16,
                 activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile and device.type == "cuda",
                 fill_from=cfg.init_from if deferred else None)
    optimizer = make_optimizer(model, cfg, device)
    found = d.symmetric(lambda: run_dir.newest_intact(
        run, lambda p: d.agree(lambda: _load_checkpoint(p, cfg, model, optimizer, d)), console.print))
    if found is None:
        ckpt = None
        files = train_set.model_files if isinstance(train_set, ChatData) else [train_set.tokenizer_path]
        for src in files:  # the tokenizer (and a checkpoint's chat template)
            if src.is_file():
                d.on_main(lambda src=src: fsio.copy_file(src, run / src.name))
        state: dict[str, Any] = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    else:
        ckpt, state = found
        console.print(f"resuming {ckpt} at step {state['step']}")
    metrics = run / run_dir.METRICS
    d.on_main(lambda: run_dir.repair_metrics(run, state["step"] if ckpt is not None else None, console.print))

    step = start_step = state["step"]
    end = cfg.max_steps if until_step is None else min(until_step, cfg.max_steps)
    batches = train_set.batches(cfg.batch_size, cfg.seq_len, cfg.seed, start_batch=step * cfg.grad_accum,
                                shift=1 if cfg.objective == "ar" else 0, rank=d.data_rank, world_size=d.data_world)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * d.data_world
    deadline = time.monotonic() + 60 * max_minutes if max_minutes is not None else None
    t_start, elapsed_before = time.monotonic(), state["elapsed_s"]
    cpu_start, cpu_before = time.process_time(), state.get("cpu_s", 0.0)  # this process's CPU time, all threads
    loss = val_loss = None
    stopped, saved = "max_steps" if step >= cfg.max_steps else "until_step", ckpt
    interrupted: list[int] = []
    streak = 0  # non-finite steps in a row
    previous_handler = _on_sigint(lambda: interrupted.append(1))
    recipe = {} if cfg.objective in ("ar", "sft") else {"t_sampling": cfg.t_sampling,
                                                        "loss_weighting": cfg.loss_weighting,
                                                        "time": cfg.diffusion_time}
    if cfg.objective == "distill":  # held-out KLs keep one draw (the same measure whatever the recipe's K)
        recipe["teacher_draws"] = cfg.teacher_draws
    loss_steps = cfg.student_steps if cfg.objective == "distill" else cfg.num_steps
    eta = Eta(end)  # the ETA of the steps to `end`, from this invocation's measured step rate
    with metrics.open("a") if d.is_main else contextlib.nullcontext() as log:
        def record(**rec: Any) -> None:
            if log is not None:  # rank 0 writes the one metrics file
                log.write(json.dumps(rec) + "\n")
                log.flush()

        def run_eval() -> float:
            console.phase(f"evaluating | held-out loss at step {step} ({cfg.eval_batches} batches)")
            model.eval()
            values = heldout_metrics(net, val_set, cfg, device, use_bf16, d)
            model.train()
            record(step=step, tokens=state["tokens"], **values)
            nelbo = (f" | held-out NELBO {values['val_nelbo']:.3f} ± {values['val_nelbo_se']:.3f} (T="
                     f"{cfg.nelbo_steps})") if "val_nelbo" in values else ""
            if "val_nelbo_continuous" in values:
                nelbo += (f" | held-out NELBO {values['val_nelbo_continuous']:.3f} ± "
                          f"{values['val_nelbo_continuous_se']:.3f} (continuous time)")
            console.print(f"step {step} | held-out loss {values['val_loss']:.4f}{nelbo}")
            eta.pause()  # an evaluation is not a training step: its time stays out of the ETA's rate
            return values["val_loss"]

        try:
            if step == 0:
                val_loss = run_eval()
            while step < end:
                lr = learning_rate(cfg, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                losses = []
                for i in range(cfg.grad_accum):
                    micro = step * cfg.grad_accum + i
                    x0 = next(batches).to(device, non_blocking=True)
                    with d.accumulating(net, sync=i == cfg.grad_accum - 1):
                        with torch.autocast(device.type, torch.bfloat16, enabled=use_bf16):
                            _, out = net(x0, objective=cfg.objective, num_steps=loss_steps,
                                         self_conditioning_prob=cfg.self_conditioning_prob, ar_weight=cfg.ar_weight,
                                         chunk_rows=cfg.chunk_rows, generator=micro_step_generator(cfg, micro, device),
                                         **recipe,
                                         batch_rows=d.rows(cfg.batch_size))
                        (out.loss / cfg.grad_accum).backward()
                    losses.append(out.loss.detach())
                grad_norm = d.clip_grad_norm(model, cfg.clip)
                # One reduction a step: the mean loss over the ranks, and whether any rank was interrupted or out of
                # time, so that every rank takes the same decisions below.
                loss, stop_interrupt, stop_time = d.sum([float(torch.stack(losses).mean()), float(bool(interrupted)),
                                                         float(deadline is not None and time.monotonic() >= deadline)])
                loss /= d.world_size
                step += 1
                if math.isfinite(loss) and math.isfinite(grad_norm):
                    optimizer.step()
                    state["tokens"] += tokens_per_step
                    streak = 0
                else:  # the NaN guard: drop this gradient; the step's data and noise stay consumed
                    streak += 1
                    record(step=step, event="skipped_nonfinite", loss=loss, grad_norm=grad_norm, lr=lr)
                    if step <= NONFINITE_FIRST_STEPS or streak >= NONFINITE_STREAK:
                        record(step=step, event="stopped_nonfinite")
                        raise shared(NonFiniteError(_nonfinite_message(cfg, step, loss, grad_norm, streak, saved)))
                    console.print(f"step {step} | skipped: non-finite loss {loss} or gradient norm {grad_norm}")
                optimizer.zero_grad(set_to_none=True)
                now = time.monotonic()
                rate = (step - start_step) * tokens_per_step / max(now - t_start, 1e-9)
                record(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=state["tokens"],
                       tokens_per_s=round(rate, 1), elapsed_s=round(elapsed_before + now - t_start, 3),
                       cpu_s=round(cpu_before + time.process_time() - cpu_start, 3))
                eta.update(step)
                left = eta.seconds()
                left = left if deadline is None or left is None else min(left, max(0.0, deadline - now))
                console.status(step, f"training | step {step}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                                     f"{rate:,.0f} tok/s | " + ("ETA measuring" if left is None else
                                                                f"ETA {duration(left)}"))
                if stop_interrupt:
                    stopped = "interrupt"
                elif stop_time:
                    stopped = "time"
                elif step == cfg.max_steps:
                    stopped = "max_steps"
                last = step == end or stopped in ("interrupt", "time")
                if step % cfg.eval_every == 0 or last:
                    val_loss = run_eval()
                if step % cfg.save_every == 0 or last:
                    state.update(step=step, elapsed_s=elapsed_before + time.monotonic() - t_start,
                                 cpu_s=cpu_before + time.process_time() - cpu_start)
                    saved = d.save_checkpoint(run, model, optimizer, cfg.to_json(), cfg.keep_last, state, last,
                                              gen, write_weights=write_weights)
                if last:
                    break
        finally:
            _restore_sigint(previous_handler)
    rate = (step - start_step) * tokens_per_step / max(time.monotonic() - t_start, 1e-9)
    console.print(f"stopped at step {step} ({stopped}); latest checkpoint: {saved}")
    return TrainResult(step, saved, loss, val_loss, rate, stopped)


def _nonfinite_message(cfg: TrainConfig, step: int, loss: float, grad_norm: float, streak: int,
                       saved: Path | None) -> str:
    when = f"{streak} steps in a row" if streak > 1 else f"one of the first {NONFINITE_FIRST_STEPS} steps"
    where = f"its last checkpoint {saved.name} is intact" if saved else "it has no checkpoint yet"
    return (f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not finite ({when}); training stopped "
            f"({where}). "
            f"Likely cause: a learning rate too high for this model (--lr {cfg.lr:g}, --weight-decay "
            f"{cfg.weight_decay:g}, --clip {cfg.clip:g}); start a new run with a lower --lr")


def _on_sigint(handler: Any) -> Any:
    """Ctrl-C finishes the current step, saves and stops (a second Ctrl-C interrupts at once)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def once(signum: int, frame: Any) -> None:
        handler()
        print("\ninterrupt: finishing this step, then a held-out evaluation and a checkpoint before exit (Ctrl-C again "
              "to stop at once, without them)", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    return signal.signal(signal.SIGINT, once)


def _restore_sigint(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
