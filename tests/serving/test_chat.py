"""The library pieces the CLI calls: ChatSession (a conversation over one KV cache), left_pad, and
GenerationConfig.overrides / for_model / stopping_at."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.data.templates import ChatTemplate
from dgemma.data.tokenizer import TURN_END, left_pad, load_tokenizer
from dgemma.model.config import ConfigError
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.chat import ChatSession, ContextFullError

FAST = {"max_denoising_steps": 3, "max_new_tokens": 32}


@pytest.fixture(scope="module")
def chat_model(tok_path):
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny"))).eval()
    tok = load_tokenizer(tok_path)
    return model, GenerationConfig.for_model(model.config).stopping_at(tok.token_to_id(TURN_END)), tok


def test_first_turn_is_generate_on_the_chat_template(chat_model):
    model, settings, tok = chat_model
    session = ChatSession(model, tok, seed=7, generation_config=settings, **FAST)
    answer = session.reply("Hello there")
    ids = torch.tensor([ChatTemplate(None).encode(tok, [{"role": "user", "content": "Hello there"}])])
    direct = dgemma.generate(model, ids, generation_config=settings, seed=7, **FAST)
    assert torch.equal(answer.sequences, direct.sequences)


def test_later_turns_reuse_the_cache_and_reset_starts_afresh(chat_model):
    model, settings, tok = chat_model
    session = ChatSession(model, tok, system="Be brief.", seed=3, generation_config=settings, **FAST)
    first = session.reply("Hi")
    committed = session.cache.length
    assert committed == first.sequences.shape[1] - model.config.canvas_length  # the last canvas is pending
    # The next prompt continues the cache: the pending canvas (cut at EOS), then the template of the new turn.
    L = model.config.canvas_length
    second_prompt = session.prompt_ids("Why?")
    assert second_prompt[:len(session.pending)] == session.pending
    assert tok.decode(second_prompt[len(session.pending):]).startswith(TURN_END)
    second = session.reply("Why?")
    assert session.turn == 2 and second.sequences.shape[1] - L >= len(second_prompt)
    assert session.cache.length == committed + second.sequences.shape[1] - L
    session.reset()
    assert session.cache.length == 0 and session.pending is None
    assert tok.decode(session.prompt_ids("Hi")) == tok.decode(
        ChatTemplate(None).encode(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))


def test_a_turn_that_does_not_fit_leaves_the_session_unchanged(chat_model):
    model, settings, tok = chat_model
    session = ChatSession(model, tok, max_context=40, seed=0, generation_config=settings, **FAST)
    with pytest.raises(ContextFullError, match="context full"):
        session.reply("Hello there, how are you today?")
    assert session.cache.length == 0 and session.pending is None and session.turn == 0


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = left_pad([[1, 2], [3, 4]], pad_id=9)
    assert ids.tolist() == [[1, 2], [3, 4]] and mask is None


def test_generation_overrides_and_model_defaults():
    g = GenerationConfig()
    assert g.overrides(max_new_tokens=64, t_min=None, sampler="lite") == {"max_new_tokens": 64, "sampler": "lite"}
    with pytest.raises(ConfigError, match="t_max"):
        g.overrides(t_max=0.1)
    with pytest.raises(ConfigError, match="unknown generation setting"):
        g.overrides(temperature=1.0)
    cfg = dgemma.preset("tiny")
    fm = GenerationConfig.for_model(cfg)
    assert (fm.eos_token_id, fm.pad_token_id, fm.bos_token_id) == ((1,), 0, 2)
    assert fm.stopping_at(4).eos_token_id == (1, 4) and fm.stopping_at(1) is fm and fm.stopping_at(None) is fm
