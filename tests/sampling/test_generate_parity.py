"""dgemma.generate against transformers' DiffusionGemmaForBlockDiffusion.generate, token for token.

Both run the same tiny random checkpoint (transformers with eager attention and experts, the bit-exact reference)
under the same seed on CPU: same random draws in the same order, so the sequences must be identical, and so must
tokens_per_forward. Prompts avoid the tiny model's image-token ids (509-511).
"""

from __future__ import annotations

import pytest
import torch

from dgemma.sampling.generate import generate
from dgemma.testing.hf import EntropyBoundSamplerConfig, build_hf_model, load_hf_model, save_hf_model
from dgemma.weights.loading import load_generation_config, load_model

CASES = {
    # geometry: (batch, prompt length, overrides)
    "tiny": [(1, 11, {}), (2, 11, {}), (2, 5, {"stability_threshold": 0, "confidence_threshold": 1.0})],
    "k8-of-16": [(2, 11, {"max_new_tokens": 40})],
    "top1-wide-window": [(1, 30, {"stability_threshold": 2, "confidence_threshold": 2.0, "entropy_bound": 0.5})],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for i, name in enumerate(CASES):
        path = tmp_path_factory.mktemp(name)
        save_hf_model(build_hf_model(name, seed=50 + i), path)
        out[name] = str(path)
    return out


def _prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 509, (batch, length), generator=torch.Generator().manual_seed(seed))


def _both(hf, model, settings, prompt, seed, **kwargs):
    """transformers' generate and dgemma's, each with the checkpoint's generation config (`settings`, dgemma's copy
    read by `load_generation_config`) and `kwargs` on top."""
    hf_kwargs = dict(kwargs)
    if "entropy_bound" in hf_kwargs:  # transformers keeps it in a sampler config (a bare kwarg is silently ignored)
        hf_kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=hf_kwargs.pop("entropy_bound"))
    torch.manual_seed(seed)
    want = hf.generate(prompt, **hf_kwargs)
    got = generate(model, prompt, generation_config=settings, seed=seed, **kwargs)
    return want, got


@pytest.mark.parametrize("geometry, case", [(g, i) for g, cases in CASES.items() for i in range(len(cases))])
def test_generate_matches_transformers_token_for_token(checkpoints, geometry, case):
    batch, length, overrides = CASES[geometry][case]
    hf = load_hf_model(checkpoints[geometry], eager=True)
    model, settings = load_model(checkpoints[geometry]), load_generation_config(checkpoints[geometry])
    for seed in (0, 1):
        want, got = _both(hf, model, settings, _prompt(batch, length, seed), seed, **overrides)
        assert torch.equal(got.sequences, want.sequences), f"seed {seed}"
        assert torch.equal(got.tokens_per_forward, want.tokens_per_forward.to(got.tokens_per_forward.dtype))
        assert got.sequences.shape[1] > length + model.config.canvas_length  # several canvases (48 new -> 3 x 16)


def test_eos_inside_a_canvas_pads_like_transformers(checkpoints):
    """Make EOS likely: declare the first canvas's most frequent token an EOS id, so one row stops mid-canvas."""
    path = checkpoints["tiny"]
    hf, model, settings = load_hf_model(path, eager=True), load_model(path), load_generation_config(path)
    prompt = _prompt(2, 11, 7)
    first = generate(model, prompt, generation_config=settings, seed=7, eos_token_id=[])
    row0 = first.sequences[0, 11:27]
    eos = int(row0.mode().values)
    want, got = _both(hf, model, settings, prompt, 7, eos_token_id=[1, eos], pad_token_id=0)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.tokens_per_forward, want.tokens_per_forward.to(got.tokens_per_forward.dtype))
    new = got.sequences[0, 11:]
    first_eos = int((new == eos).nonzero()[0])
    assert (new[first_eos + 1:] == 0).all() and first_eos < 16  # padded after the first EOS, inside canvas 1
    assert got.stop_reasons[-1][0] == "finished" or got.sequences.shape[1] == 11 + 16


def test_bf16_generate_matches_transformers(checkpoints):
    path = checkpoints["tiny"]
    hf = load_hf_model(path, dtype=torch.bfloat16, eager=True)
    model = load_model(path, dtype=torch.bfloat16)
    want, got = _both(hf, model, load_generation_config(path), _prompt(2, 11, 3), 3)
    assert torch.equal(got.sequences, want.sequences)


def test_multi_turn_cache_continues_like_transformers(checkpoints):
    """Continue a conversation from the returned cache: feed the uncommitted last canvas plus the new turn."""
    path = checkpoints["tiny"]
    hf, model, settings = load_hf_model(path, eager=True), load_model(path), load_generation_config(path)
    prompt, turn = _prompt(1, 11, 9), _prompt(1, 4, 10)
    want1, got1 = _both(hf, model, settings, prompt, 9, max_new_tokens=16)
    assert torch.equal(got1.sequences, want1.sequences)
    assert got1.cache.length == want1.past_key_values.get_seq_length() == 11  # the last canvas is not committed
    follow = torch.cat([got1.sequences[:, 11:], turn], 1)
    torch.manual_seed(11)
    want2 = hf.generate(follow, past_key_values=want1.past_key_values, max_new_tokens=16)
    got2 = generate(model, follow, generation_config=settings, cache=got1.cache, seed=11, max_new_tokens=16)
    assert torch.equal(got2.sequences, want2.sequences)


# The reproduction of the fidelity issue: a geometry the hand-picked cases above do not use (5 layers S,S,F,S,F,
# 2 heads / 1 KV head, head_dim 32 / global 64, window 16 < the 40-token prompt, 4 experts top-1, canvas 8, vocab
# 1000, EOS [1, 7]), seeds 0-9, batch 1 and 2, one to three canvases.
ISSUE_TEXT = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
    sliding_window=16, num_experts=4, top_k_experts=1, moe_intermediate_size=40, pad_token_id=0,
    eos_token_id=[1, 7], bos_token_id=2,
)  # fmt: skip
ISSUE_GENERATION = dict(max_denoising_steps=10, t_min=0.4, t_max=0.8, stability_threshold=1,
                        confidence_threshold=0.005, eos_token_id=[1, 7], pad_token_id=0)


@pytest.mark.integration
def test_the_fidelity_issue_reproduction_is_token_identical(tmp_path):
    hf = build_hf_model("tiny", seed=0, canvas_length=8, text_overrides=ISSUE_TEXT)
    hf.generation_config.update(sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), **ISSUE_GENERATION)
    save_hf_model(hf, tmp_path)
    hf, model, settings = load_hf_model(tmp_path, eager=True), load_model(tmp_path), load_generation_config(tmp_path)
    assert settings.eos_token_id == (1, 7)
    for batch in (1, 2):
        for seed in range(10):
            prompt = torch.randint(0, 1000, (batch, 40), generator=torch.Generator().manual_seed(100 + seed))
            for new in (8, 16, 24):
                want, got = _both(hf, model, settings, prompt, seed, max_new_tokens=new)
                where = f"batch {batch} seed {seed} max_new_tokens {new}"
                assert torch.equal(got.sequences, want.sequences), where
                assert torch.equal(got.tokens_per_forward, want.tokens_per_forward), where
