"""dgemma in EleutherAI's lm-evaluation-harness: the `dgemma` model of lm-eval's registry (`pip install
'dgemma[eval]'`; docs/evaluation.md "lm-evaluation-harness"). lm-eval's own command line cannot find a model defined
outside it, so `dgemma lm-eval ...` (dgemma/cli/lm_eval.py) registers this one and runs lm-eval's command line;
in Python, importing this module registers it for `lm_eval.simple_evaluate(model="dgemma", ...)`.

    --model_args pretrained=RUN_OR_CHECKPOINT[,device=cpu|cuda|auto][,dtype=auto|float32|bfloat16|float64]
                 [,batch_size=N][,mc_replicates=R][,nelbo_steps=T|continuous][,t_samples=K][,seed=S]
                 [,max_gen_toks=N][,max_length=N][,impl=reference|fast][,bound=continuation|prompt]

    loglikelihood          AR run: the exact log p(continuation | context), is_greedy as lm-eval's HF model.
                           Diffusion run: minus the continuation's NELBO given the committed context, a LOWER bound
                           on the log-probability (the NELBO is an upper bound on the NLL), estimated by Monte Carlo
                           (`t_samples` stratified t per canvas; `mc_replicates` R > 1: the mean of R independent
                           estimates); is_greedy: each token is the argmax of the denoising posterior at its position
                           with its canvas at pure noise (dgemma/eval/continuations.py). bound=prompt: the bound
                           `dgemma serve` answers lm-eval's local-completions with (context and continuation bounded
                           as one prompt; with nelbo_steps=16, t_samples=4 and seed=1234, the seed local-completions
                           sends: the server's numbers)
    loglikelihood_rolling  the same over windows of `max_length` tokens (default: the run's training seq_len)
    generate_until         dgemma's generation (the diffusion sampler; token by token for an AR run) with the
                           checkpoint's generation_config.json, then the request's gen_kwargs: `until`,
                           `max_gen_toks`, `temperature` (> 0: a constant temperature, t_min = t_max), `do_sample:
                           false` or `temperature: 0` (greedy: top_k = 1), and any GenerationConfig field (sampler,
                           max_denoising_steps, entropy_bound, top_p, ...); the output is cut at the first `until`
                           string and at the first EOS
"""

from __future__ import annotations

import json
import logging
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while it is empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from dgemma.data.tokenizer import left_pad, load_tokenizer
from dgemma.eval.continuations import BOUNDS, ContinuationScore, fit_context, score_ar, score_diffusion
from dgemma.eval.evaluate import run_info
from dgemma.sampling.generation_config import GenerationConfig, offset_seed
from dgemma.weights.loading import DTYPES, load_generation_config, load_model

LOG = logging.getLogger("lm_eval.dgemma")  # under lm-eval's logger: shown as its own lines are
DEFAULT_MAX_LENGTH = 2048  # the window of a checkpoint without a training seq_len (capped by its positions)
DTYPE_NAMES = {**DTYPES, "float64": torch.float64}


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--model_args {name}={value!r}: expected an integer >= 1")
    return value


@register_model("dgemma")
class DgemmaLM(TemplateLM):
    """A dgemma run (AR or diffusion) as an lm-eval model, in process; see the module's docstring."""

    def __init__(self, pretrained: str | None = None, device: str | None = "cpu", dtype: str | None = "auto",
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, mc_replicates: int = 1,
                 nelbo_steps: int | str | None = None, t_samples: int | None = None, seed: int = 0,
                 max_gen_toks: int = 256, max_length: int | None = None, impl: str = "reference",
                 bound: str = "continuation", **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise ValueError(f"--model_args: unknown argument(s) {', '.join(sorted(unknown))}; dgemma takes "
                             "pretrained, device, dtype, batch_size, mc_replicates, nelbo_steps, t_samples, seed, "
                             "max_gen_toks, max_length, impl, bound")
        if not pretrained:
            raise ValueError("--model_args pretrained=RUN_OR_CHECKPOINT is required (a dgemma run or model directory)")
        if bound not in BOUNDS:
            raise ValueError(f"--model_args bound={bound!r}: expected {' or '.join(BOUNDS)}")
        self.bound = bound
        if dtype not in (None, "auto", *DTYPE_NAMES):
            raise ValueError(f"--model_args dtype={dtype!r}: expected auto, {', '.join(DTYPE_NAMES)}")
        if device in (None, "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--model_args device={device}: no CUDA device is available")
        info = run_info(str(pretrained))
        if info.tokenizer_path is None:
            raise ValueError(f"{pretrained}: no tokenizer.json in the run or checkpoint (lm-eval's requests are text)")
        self.autoregressive = info.objective == "ar"
        self.model = load_model(info.model_dir, dtype=None if dtype in (None, "auto") else DTYPE_NAMES[dtype],
                                device=device, impl=impl).eval()
        self.gcfg = load_generation_config(info.model_dir)
        self.tokenizer = load_tokenizer(info.tokenizer_path)
        cfg = self.model.config
        # lm-eval's --batch_size auto (or auto:N) asks it to find one: here requests go `batch_size` rows at a time
        self.batch_size = 1 if batch_size is None or str(batch_size).startswith("auto") else \
            _positive("batch_size", batch_size)
        self.mc_replicates = _positive("mc_replicates", mc_replicates)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"--model_args seed={seed!r}: expected an integer >= 0")
        self.seed = seed
        self.max_gen_toks = _positive("max_gen_toks", max_gen_toks)
        length = max_length if max_length is not None else info.get("seq_len") or DEFAULT_MAX_LENGTH
        self.max_length = min(_positive("max_length", length), cfg.max_position_embeddings)
        if nelbo_steps is None:
            self.num_steps = None if info.get("diffusion_time") == "continuous" else int(info.get("num_steps", 16))
        elif nelbo_steps == "continuous":
            self.num_steps = None
        else:
            self.num_steps = _positive("nelbo_steps", nelbo_steps)
        self.t_samples = _positive("t_samples", t_samples if t_samples is not None else min(4, self.num_steps or 4))
        if self.num_steps is not None and self.t_samples > self.num_steps:
            raise ValueError(f"--model_args t_samples={self.t_samples} exceeds nelbo_steps T = {self.num_steps}")
        self.pretrained = str(pretrained)
        self.last_scores: list[ContinuationScore] = []  # the latest loglikelihood call's, with their Monte Carlo SE

    # --- what TemplateLM asks ----------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.gcfg.eos_token_id[0] if self.gcfg.eos_token_id else 0

    @property
    def prefix_token_id(self) -> int:
        return self.gcfg.bos_token_id if self.gcfg.bos_token_id is not None else self.eot_token_id

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens is not False)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- scoring ------------------------------------------------------------------------------------------------------

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[ContinuationScore]:
        """`continuations.score_ar` or `score_diffusion` of (context, continuation) id pairs, each context cut from
        the left to fit `max_length` with its continuation (a continuation longer than `max_length` is scored whole,
        with what context the model's positions leave); an empty continuation scores 0 (greedy)."""
        L = self.model.config.canvas_length
        fitted, which = [], []
        for i, (ctx, cont) in enumerate(pairs):
            if cont:
                span = len(cont) if self.autoregressive else -(-len(cont) // L) * L
                window = min(max(self.max_length, span), self.model.config.max_position_embeddings)
                fitted.append((fit_context(ctx, span, window + self.autoregressive), cont))
                which.append(i)
        if self.autoregressive:
            scored = score_ar(self.model, fitted, batch_size=self.batch_size)
        else:
            scored = score_diffusion(self.model, fitted, num_steps=self.num_steps, num_t_samples=self.t_samples,
                                     mc_replicates=self.mc_replicates, seed=self.seed, bound=self.bound)
        out = [ContinuationScore(0.0, True, 0, exact=self.autoregressive)] * len(pairs)
        for i, s in zip(which, scored, strict=True):
            out[i] = s
        return out

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        scores = self.score([(list(ctx), list(cont)) for _, ctx, cont in requests])
        self.last_scores = scores
        ses = [s.mc_se for s in scores if s.mc_se is not None]
        if not self.autoregressive:
            LOG.info("dgemma: %d continuations scored by minus their NELBO (a lower bound on log p; bound=%s, T=%s, "
                     "%d t-samples per canvas, %d replicate(s)%s)", len(scores), self.bound,
                     self.num_steps or "continuous", self.t_samples, self.mc_replicates,
                     f", mean Monte Carlo SE {sum(ses) / len(ses):.3f} nats" if ses else "")
        for (key, _, _), s in zip(requests, scores, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, (s.logprob, s.is_greedy))
        return [(s.logprob, s.is_greedy) for s in scores]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood (a bound for a diffusion run) of whole texts, in disjoint windows of at most
        `max_length` tokens (for a diffusion run, of whole canvases with a context token), each given the token
        before it (lm-eval's rolling windows)."""
        L = self.model.config.canvas_length
        window = self.max_length if self.autoregressive else max(L, (self.max_length - 1) // L * L)
        out = []
        for req in requests:
            (text,) = req.args
            pairs = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, window, 1)]
            total = sum(s.logprob for s in self.score([(list(c), list(x)) for c, x in pairs]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # --- generation ---------------------------------------------------------------------------------------------------

    def settings(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int, GenerationConfig]:
        """A request's `until` strings, its token budget, and the generation settings it asks for (see the module)."""
        kw = dict(gen_kwargs)
        until = kw.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        budget = _positive("max_gen_toks", kw.pop("max_gen_toks", self.max_gen_toks))
        do_sample = kw.pop("do_sample", None)
        temperature = kw.pop("temperature", None)
        if do_sample is False or temperature == 0:
            kw["top_k"] = 1
        elif temperature is not None:
            kw["t_min"] = kw["t_max"] = float(temperature)
        return until, budget, self.gcfg.replace(**kw, max_new_tokens=budget)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for members in groups.values():
            until, budget, config = self.settings(requests[members[0]].args[1])
            for lo in range(0, len(members), self.batch_size):
                rows = members[lo:lo + self.batch_size]
                prompts = [self._prompt(requests[i].args[0], budget) for i in rows]
                new = self._generate(prompts, config, offset_seed(self.seed, rows[0]))
                for i, ids in zip(rows, new, strict=True):
                    text = self.tok_decode(self._until_eos(ids[:budget]))
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [t or "" for t in out]

    def _prompt(self, context: str, budget: int) -> list[int]:
        L = self.model.config.canvas_length
        room = self.model.config.max_position_embeddings - (budget if self.autoregressive else -(-budget // L) * L)
        ids = self.tok_encode(context)
        return ids[max(0, len(ids) - max(1, room)):] or [self.prefix_token_id]

    def _until_eos(self, ids: list[int]) -> list[int]:
        eos = set(self.gcfg.eos_token_id)
        return next((ids[:k] for k, t in enumerate(ids) if t in eos), ids)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], config: GenerationConfig, seed: int) -> list[list[int]]:
        if self.autoregressive:
            from dgemma.eval.decoding import ar_decode

            out = []
            for k, ids in enumerate(prompts):
                g = torch.Generator(self.model.device).manual_seed(offset_seed(seed, k))
                out.append(ar_decode(self.model, torch.tensor(ids), config, temperature=config.t_max, generator=g))
            return out
        from dgemma.sampling.generate import generate

        input_ids, mask = left_pad(prompts, config.pad_token_id or 0, self.model.device)
        result = generate(self.model, input_ids, generation_config=config, attention_mask=mask, seed=seed)
        return result.new_tokens()


__all__ = ["DgemmaLM"]
