"""What `dgemma generate` and `dgemma chat` share: model and tokenizer loading, the sampler flags, UsageError, and
the streaming display (committed text, and in a terminal the canvas being refined)."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import dgemma
from dgemma import lora
from dgemma.checkpoint import resolve_model_dir
from dgemma.config import ConfigError
from dgemma.generation_config import GenerationConfig
from dgemma.model import check_memory
from dgemma.offload import offload_experts
from dgemma.quantize import check_supported, quantize_model
from dgemma.tokenizer import TURN_END, Tokenizer, check_vocab, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LIVE_INTERVAL_S = 0.1  # redraw the refining canvas at most 10 times a second: terminals are slow, steps are not


class UsageError(ConfigError):
    """A bad command-line input (prompt, ids, tokenizer, flags). A ConfigError, so `dgemma` prints it on one line
    and exits 2."""


def shown_path(path: Path) -> str:
    """A path as a command printed in a report or a figure's footer shows it: relative to the current directory when
    it lies inside it (so pictures made from a run directory carry no absolute temporary paths), else as given."""
    if path.is_absolute():
        try:
            return str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
    return str(path)


_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "str | None": str}


def add_config_args(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One --kebab-case flag per dataclass field (but `skip`), typed from its annotation, with the field's help and
    choices. Every flag defaults to None (= not given), so the defaults live only in the dataclass and its presets."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kw: dict[str, Any] = {"default": None, "dest": f.name, "help": f.metadata.get("help")}
        if f.type == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _TYPES[str(f.type)]
            kw["choices"] = f.metadata.get("choices")
            kw["metavar"] = None if kw["choices"] else {int: "N", float: "X", str: "NAME"}[kw["type"]]
        p.add_argument("--" + f.name.replace("_", "-"), **kw)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, metavar="DIR", help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--preset", metavar="NAME", help="a named preset, with --random-init (smoke tests)")
    p.add_argument("--random-init", action="store_true", help="random weights for --preset (dgemma.init_weights)")
    p.add_argument("--tokenizer", type=Path, metavar="PATH", help="tokenizer.json or its folder (default: in --model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's (float32 for a preset)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--force", action="store_true",
                   help="skip the memory pre-flight (load and generate even if the estimate exceeds free memory)")
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantization at load time (torchao: pip install 'dgemma[quant]'); int4 on CUDA")
    p.add_argument("--offload-experts", action="store_true",
                   help="keep the routed experts out of memory: memory-mapped from the checkpoint (CPU) or in pinned "
                        "host memory (CUDA), read per layer")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """Flags that override the checkpoint's generation_config.json for this run."""
    p.add_argument("--sampler", choices=("entropy-bound", "lite"))
    p.add_argument("--max-new-tokens", type=int, metavar="N")
    p.add_argument("--steps", type=int, metavar="N", help="max denoising steps per canvas")
    p.add_argument("--entropy-bound", type=float, metavar="X")
    p.add_argument("--t-min", type=float, metavar="X", help="final temperature")
    p.add_argument("--t-max", type=float, metavar="X", help="initial temperature")
    p.add_argument("--seed", type=int, metavar="N")


def overrides(args: argparse.Namespace, gcfg: GenerationConfig) -> dict[str, Any]:
    """generate()'s keyword overrides from the sampler flags given (GenerationConfig.overrides checks them)."""
    return gcfg.overrides(sampler=args.sampler, max_new_tokens=args.max_new_tokens, max_denoising_steps=args.steps,
                          entropy_bound=args.entropy_bound, t_min=args.t_min, t_max=args.t_max)


def load(args: argparse.Namespace) -> tuple[Any, Tokenizer | None]:
    """The model (from --model, or --preset --random-init) and its tokenizer (None if there is none)."""
    if (args.model is None) == (args.preset is None):
        raise UsageError("give exactly one of --model DIR and --preset NAME")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    dtype = DTYPES.get(args.dtype)
    if args.preset is not None:
        if not args.random_init:
            raise UsageError(f"--preset {args.preset} has no weights: add --random-init, or load one with --model")
        config = dgemma.preset(args.preset)
        # Before anything is built: the weights and one canvas's sampler buffers must fit in free memory.
        quantize = getattr(args, "quantize", None)
        if quantize is not None:
            check_supported(quantize, args.device, dtype or torch.float32)
        check_memory(config, dtype or torch.float32, args.device, weights=True, batch_size=1,
                     force=getattr(args, "force", False), quantize=quantize)
        model = dgemma.init_weights(dgemma.DiffusionGemma(config))
        model = quantize_model(model.to(dtype=dtype or torch.float32, device=args.device).eval(), quantize)
        if getattr(args, "offload_experts", False):
            _offload_to_temp_file(model, quantize)
        model.generation_config = GenerationConfig.for_model(model.config)
    else:
        if args.random_init:
            raise UsageError("--random-init goes with --preset; --model loads the checkpoint's weights")
        force = getattr(args, "force", False)
        quantize, offload = getattr(args, "quantize", None), getattr(args, "offload_experts", False)
        if lora.is_adapter(resolve_model_dir(args.model)):  # a LoRA run or adapter: its base with it merged
            model = lora.load_merged(resolve_model_dir(args.model), dtype=dtype, device=args.device, force=force)
            model = quantize_model(model, quantize)  # merged in memory first, then quantized or offloaded
            if offload:
                _offload_to_temp_file(model, quantize)
        else:
            model = dgemma.load_model(args.model, dtype=dtype, device=args.device, force=force, quantize=quantize,
                                      offload_experts=offload)
    path = args.tokenizer or (args.model / "tokenizer.json" if args.model is not None else None)
    tok = None
    if path is not None and (args.tokenizer is not None or path.exists()):
        try:
            tok = load_tokenizer(path)
            check_vocab(tok, model.config)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.preset is not None:  # a random model with a chat tokenizer stops at <turn|>, as Gemma's does
            model.generation_config = model.generation_config.stopping_at(tok.token_to_id(TURN_END))
    return model, tok


def _offload_to_temp_file(model: Any, quantize: str | None) -> None:
    """--offload-experts for a model built in memory: its experts written to a temporary file (removed at exit) and
    memory-mapped from there (dgemma/offload.py)."""
    if quantize is not None:
        raise UsageError("--offload-experts and --quantize do not combine: pick one")
    folder = tempfile.mkdtemp(prefix="dgemma-experts-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    offload_experts(model, Path(folder) / "experts.safetensors")


class Streamer:
    """on_canvas: prints each committed canvas's new text (one row: as a running stream; a batch: one line per row
    and canvas). on_step, when `stream` is a terminal: redraws the canvas being refined below the text, with ANSI
    escapes, and erases it before the next committed text."""

    def __init__(self, tok: Tokenizer | None, eos: tuple[int, ...], pad: int | None, batch_size: int, *,
                 quiet: bool = False, stream: Any = None, live: bool | None = None):
        self.tok, self.eos, self.pad, self.quiet = tok, set(eos), pad, quiet
        self.out = stream or sys.stdout
        self.live = (not quiet and self.out.isatty()) if live is None else live
        self.ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.shown, self.done = [""] * batch_size, [False] * batch_size
        self.last_canvas: list[list[int]] = [[] for _ in range(batch_size)]  # cut before EOS; chat re-feeds it
        self.col, self.drawn, self.last_draw = 0, 0, 0.0

    def text(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f" {i}" for i in ids)
        # Control bytes (an untrained model emits any) would act on the terminal; show them as U+FFFD.
        return self.tok.decode(ids, skip_special_tokens=True).translate(_CONTROL)

    def on_canvas(self, index: int, tokens: torch.Tensor) -> None:
        self._erase()
        for r, row in enumerate(tokens.tolist()):
            if self.done[r]:
                continue
            cut = next((j for j, t in enumerate(row) if t in self.eos), None)
            self.done[r] = cut is not None
            self.last_canvas[r] = row[:cut]
            kept = [t for t in row[:None if cut is None else cut + 1] if t != self.pad]
            self.ids[r] += kept
            full = self.text(self.ids[r])
            new, self.shown[r] = full[len(self.shown[r]):], full
            if self.quiet:
                continue
            if len(self.ids) == 1:
                self.out.write(new)
                self.col = (len(full) - full.rfind("\n") - 1) % shutil.get_terminal_size().columns
            else:
                self.out.write(f"[{r}] canvas {index}: {_oneline(self.text(kept))}\n")
        self.out.flush()

    def on_step(self, info: Any) -> None:
        now = time.monotonic()
        if not self.live or now - self.last_draw < LIVE_INTERVAL_S:
            return
        self.last_draw = now
        width = shutil.get_terminal_size().columns - 1
        lines = []
        for r in [r for r in range(len(self.ids)) if not self.done[r]][:4]:
            acc = int(info.accepted[r].sum())
            head = (f"{'' if len(self.ids) == 1 else f'[{r}] '}canvas {info.canvas} step {info.step}/{info.num_steps} "
                    f"H={float(info.mean_entropy[r]):.3f} acc {acc}/{info.accepted.shape[-1]} | ")
            lines.append((head + _oneline(self.text(info.argmax[r].tolist())))[:width])
        self._erase()
        if not lines:
            return
        # Below the committed text, then back up to where it ends: relative moves survive the terminal scrolling.
        self.out.write("".join("\n\x1b[2m" + s + "\x1b[0m" for s in lines) + f"\x1b[{len(lines)}A\x1b[{self.col + 1}G")
        self.out.flush()
        self.drawn = len(lines)

    def _erase(self) -> None:
        if self.drawn:
            self.out.write("\x1b[J")  # clear from the cursor (end of committed text) to the end of the screen
            self.drawn = 0

    def close(self) -> None:
        self._erase()
        if len(self.ids) == 1 and not self.quiet and self.shown[0]:
            self.out.write("\n")
        self.out.flush()


_CONTROL = {c: "\ufffd" for c in (*range(9), *range(11, 32), 127)}  # all but tab and newline


def _oneline(s: str) -> str:
    return s.translate({c: "⏎" if c == 10 else " " for c in range(32)})


def run_training(args: argparse.Namespace, resolve_config: Any, next_step: str) -> int:
    """What `dgemma train` and `dgemma finetune` do with their parsed flags: resolve the TrainConfig (every rank of a
    torchrun job parses the same flags and files, so rank 0 alone shows what is wrong with them), run the trainer as
    this rank of the job (or as the one process), and print where to go next."""
    from dgemma.distributed import Dist, shared
    from dgemma.train import train

    allow_new_data = getattr(args, "allow_new_data", False)
    try:
        if args.minutes is not None and args.minutes <= 0:
            raise ConfigError(f"--minutes must be > 0, got {args.minutes}")
        cfg = resolve_config(args)
        if args.print_config:
            print(json.dumps(cfg.to_json(), indent=2))
            return 0
        if allow_new_data and not args.resume:
            raise ConfigError("--allow-new-data goes with --resume")
        dist = Dist.from_env(cfg.device)  # under torchrun: this rank of the job (the process group); else one process
    except Exception as e:
        shared(e)
        raise
    try:
        with dist.peers_lost():
            result = train(cfg, args.data, args.out, resume=args.resume, allow_new_data=allow_new_data,
                           max_minutes=args.minutes, until_step=args.until_step, dist=dist)
    finally:
        dist.close()
    val = f", held-out loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    if dist.is_main:
        print(f"done: step {result.step}{val}; {next_step}")
    return 0
