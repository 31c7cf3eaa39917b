"""Tokenizer, chat template, and the `generate` / `chat` commands, driven in-process against a stand-in
`dgemma.generate` module (the CLI looks it up in sys.modules at call time), so these tests check the CLI's own
work: parsing, prompts, batching, streaming, JSON, errors, cache reuse between chat turns."""

from __future__ import annotations

import io
import json
import re
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.cli.chat import next_turn_text
from dgemma.cli.generate import Streamer
from dgemma.tokenizer import (
    build_test_tokenizer,
    chat_token_ids,
    check_vocab,
    encode_template,
    format_chat,
    load_tokenizer,
)

TINY = dgemma.preset("tiny")  # vocab 512, canvas 16, pad 0, eos 1, bos 2
L = TINY.canvas_length


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_test_tokenizer(512, path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    return load_tokenizer(tok_path)


# --- tokenizer and template -----------------------------------------------------------------------------------

def test_test_tokenizer_round_trip(tok, tok_path, tmp_path):
    assert tok.vocab_size == 512
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>")] == [0, 1, 2, 3, 4]
    assert tok.bos_id == 2
    text = "The cat sees the red ball.\nNaïve café, 42 ✓"
    ids = tok.encode(text)
    assert ids[0] == 2 and 2 not in ids[1:]  # the post-processor prepends one <bos>, as Gemma's does
    assert max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text
    build_test_tokenizer(512, tmp_path)  # deterministic, and a directory path gets tokenizer.json
    assert (tmp_path / "tokenizer.json").read_bytes() == tok_path.read_bytes()


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        build_test_tokenizer(100)


def test_chat_template_exact():
    assert format_chat([{"role": "user", "content": "Hi"}]) == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\n"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]
    assert format_chat(messages) == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
                                     "<|turn>model\nHello!<turn|>\n<|turn>user\nWhy?<turn|>\n<|turn>model\n")
    assert format_chat(messages[:2], add_generation_prompt=False).endswith("Hi<turn|>\n")
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        format_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="system message must come first"):
        format_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_chat_token_ids_single_bos_and_control_ids(tok):
    ids = chat_token_ids(tok, [{"role": "user", "content": "Hello"}])
    assert ids[:2] == [2, 3] and ids.count(2) == 1  # one <bos>, not two
    assert ids.count(3) == 2 and ids.count(4) == 1  # <|turn> twice, <turn|> once: one id each
    assert tok.decode(ids) == format_chat([{"role": "user", "content": "Hello"}])
    # The chat history built turn by turn is the template of the whole conversation.
    first = chat_token_ids(tok, [{"role": "user", "content": "Hi"}])
    answer = tok.encode("Hello!", add_special_tokens=False)
    whole = chat_token_ids(tok, [{"role": "user", "content": "Hi"}, {"role": "model", "content": "Hello!"},
                                 {"role": "user", "content": "Why?"}])
    assert first + answer + encode_template(tok, next_turn_text("Why?")) == whole


def test_check_vocab(tok):
    check_vocab(tok, TINY)
    check_vocab(tok, TINY.replace(vocab_size=1024))  # a smaller tokenizer is fine (Gemma pads the embedding)
    with pytest.raises(ValueError, match=r"512 ids but the model's vocab_size is 300"):
        check_vocab(tok, TINY.replace(vocab_size=300))


# --- the CLI against a stand-in generate -----------------------------------------------------------------------

class FakeGenerate:
    """Two canvases per row: `body` (len > L), then EOS and padding. Calls on_step and on_canvas as generate does;
    with a cache, advances it as committing the prompt and the first canvas would. Per-canvas lists are
    [canvas][row], as dgemma.generate returns them."""

    def __init__(self, body: list[int]):
        self.body, self.calls = body, []

    def generate(self, model, input_ids, **kw):
        self.calls.append({"model": model, "input_ids": input_ids.tolist(), **kw})
        B, T = input_ids.shape
        eos, pad = model.generation_config.eos_token_id[0], model.generation_config.pad_token_id or 0
        flat = [*self.body, eos] + [pad] * (2 * L - len(self.body) - 1)
        canvases = [torch.tensor([flat[:L]] * B), torch.tensor([flat[L:]] * B)]
        for c, canvas in enumerate(canvases):
            kw["on_step"](SimpleNamespace(canvas=c, step=1, num_steps=4, argmax=canvas, mean_entropy=torch.zeros(B),
                                          accepted=torch.ones(B, L, dtype=torch.bool),
                                          done=torch.zeros(B, dtype=torch.bool)))
            kw["on_canvas"](c, canvas)
        cache = kw.get("cache")
        if cache is not None:
            cache.finish_write(cache.length + T + L)
        new = [[*self.body, eos]] * B
        return SimpleNamespace(sequences=torch.cat([input_ids, *canvases], 1), new_tokens=lambda: new,
                               tokens_per_forward=torch.full((B,), 2.5), steps_per_canvas=[[4] * B, [3] * B],
                               stop_reasons=[["max_steps"] * B, ["eos"] * B], cache=cache,
                               trace=SimpleNamespace(save=lambda p: self.calls[-1].setdefault("trace_saved", p)))


@pytest.fixture
def fake(monkeypatch, tok):
    f = FakeGenerate(tok.encode("The cat sees the red ball. A dog likes the blue sky.", add_special_tokens=False))
    assert len(f.body) > L
    monkeypatch.setitem(sys.modules, "dgemma.generate", types.SimpleNamespace(generate=f.generate))
    return f


RANDOM = ["--preset", "tiny", "--random-init"]


def test_generate_prompt_ids_random_preset(fake, capsys):
    fake.body = list(range(10, 30))
    assert cli.main(["generate", *RANDOM, "--prompt-ids", "5, 6,7", "--seed", "3", "--steps", "4",
                     "--sampler", "lite", "--max-new-tokens", "32"]) == 0
    out, err = capsys.readouterr()
    call = fake.calls[0]
    assert call["input_ids"] == [[5, 6, 7]] and call["attention_mask"] is None and call["seed"] == 3
    assert (call["max_denoising_steps"], call["sampler"], call["max_new_tokens"]) == (4, "lite", 32)
    assert "entropy_bound" not in call and call["trace"] is False
    assert out == "".join(f" {i}" for i in [*range(10, 30), 1]) + "\n"  # streamed ids, pads dropped after EOS
    assert "21 tokens generated for 1 prompt(s) in 2 canvas(es), 2.50 tokens/forward" in err


def test_generate_json_chat_from_model_dir(fake, tok_path, tmp_path, capsys):
    model = dgemma.init_weights(dgemma.DiffusionGemma(TINY))
    dgemma.save_pretrained(model, tmp_path, generation_config=dgemma.GenerationConfig(eos_token_id=(1, 4),
                                                                                       pad_token_id=0))
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())  # found next to the weights
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hello", "--chat", "--json",
                     "--trace", str(tmp_path / "t.npz")]) == 0
    out, _ = capsys.readouterr()
    (line,) = out.splitlines()  # --json: nothing but one object per prompt on stdout
    rec = json.loads(line)
    assert set(rec) == {"prompt", "prompt_ids", "text", "token_ids", "tokens_per_forward", "steps_per_canvas",
                        "stop_reasons"}
    assert rec["prompt"] == "Hello" and rec["prompt_ids"][:2] == [2, 3]
    assert rec["text"] == "The cat sees the red ball. A dog likes the blue sky."
    assert rec["token_ids"] == [*fake.body, 1] and rec["tokens_per_forward"] == 2.5
    assert rec["steps_per_canvas"] == [4, 3] and rec["stop_reasons"] == ["max_steps", "eos"]
    assert fake.calls[0]["trace"] is True and fake.calls[0]["trace_saved"] == tmp_path / "t.npz"


def test_generate_batch_file_left_pads(fake, tok, tok_path, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nWhat is the capital of France?\n")
    assert cli.main(["generate", *RANDOM, "--tokenizer", str(tok_path), "--batch-file", str(prompts)]) == 0
    out, err = capsys.readouterr()
    call = fake.calls[0]
    a, b = tok.encode("Hello"), tok.encode("What is the capital of France?")
    assert call["input_ids"] == [[0] * (len(b) - len(a)) + a, b]
    assert call["attention_mask"].tolist() == [[0] * (len(b) - len(a)) + [1] * len(a), [1] * len(b)]
    lines = out.splitlines()
    assert [line[:12] for line in lines] == ["[0] canvas 0", "[1] canvas 0", "[0] canvas 1", "[1] canvas 1"]
    assert "for 2 prompt(s)" in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "  "], "empty prompt: --prompt is blank"),
    (["--prompt-ids", ""], "empty prompt"),
    (["--prompt-ids", "5,512"], r"prompt ids \[512\] are outside the model's vocabulary \[0, 512\)"),
    (["--prompt-ids", "5,x"], "must be comma-separated integers"),
    (["--prompt", "Hi", "--prompt-ids", "5"], "exactly one of --prompt, --prompt-ids, --batch-file"),
    (["--prompt", "Hi"], "text prompts need a tokenizer"),
    (["--prompt-ids", "5", "--chat"], "--chat needs text"),
    (["--prompt-ids", "5", "--entropy-bound", "0"], "entropy_bound: must be a number > 0"),
    (["--prompt-ids", "5", "--tokenizer", "BIG"], "has 600 ids but the model's vocab_size is 512"),
    (["--prompt-ids", "5", "--tokenizer", "MISSING"], "no such tokenizer file"),
])
def test_generate_bad_input(fake, capsys, tmp_path, argv, message):
    if "BIG" in argv:
        build_test_tokenizer(600, tmp_path / "big.json")
    argv = [str(tmp_path / "big.json") if a == "BIG" else str(tmp_path / "x.json") if a == "MISSING" else a
            for a in argv]
    assert cli.main(["generate", *RANDOM, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgemma generate: error: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert not fake.calls


def test_generate_needs_weights(fake, capsys, tmp_path):
    assert cli.main(["generate", "--preset", "tiny", "--prompt-ids", "5"]) == 2
    assert "add --random-init" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path / "none"), "--prompt-ids", "5"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_chat_pipe_reuses_cache(fake, tok, tok_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nWhy?\n/reset\nAgain\n"))
    assert cli.main(["chat", *RANDOM, "--tokenizer", str(tok_path), "--system", "Be brief.", "--seed", "7"]) == 0
    out, err = capsys.readouterr()
    first, second, third = fake.calls
    assert first["input_ids"] == [chat_token_ids(tok, [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Hello there"}])]
    assert isinstance(first["cache"], dgemma.KVCache) and second["cache"] is first["cache"]
    # Only what is not in the cache: the answer's last canvas (before its EOS), then the next turn's template.
    assert second["input_ids"] == [fake.body[L:] + encode_template(tok, next_turn_text("Why?"))]
    assert (first["seed"], second["seed"]) == (7, 8)
    assert out.splitlines() == ["The cat sees the red ball. A dog likes the blue sky."] * 3
    assert "(history cleared)" in err
    assert third["input_ids"][0][:2] == [2, 3]  # after /reset: a fresh conversation, <bos> first
    assert third["cache"].length == len(third["input_ids"][0]) + L
    # A random model with a chat tokenizer stops on <turn|> too, as Gemma's generation_config.json does.
    assert first["model"].generation_config.eos_token_id == (1, 4)


def test_chat_needs_tokenizer(fake, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert cli.main(["chat", *RANDOM]) == 2
    assert "chat needs a tokenizer" in capsys.readouterr().err


def test_streamer_live_view_on_a_terminal(tok):
    out = io.StringIO()
    s = Streamer(tok, (1,), 0, 1, stream=out, live=True)
    ids = torch.tensor([tok.encode("The cat", add_special_tokens=False) + [0] * (L - 3)])
    s.on_step(SimpleNamespace(canvas=0, step=2, num_steps=8, argmax=ids, mean_entropy=torch.tensor([0.25]),
                              accepted=torch.ones(1, L, dtype=torch.bool), done=torch.zeros(1, dtype=torch.bool)))
    drawn = out.getvalue()
    assert "canvas 0 step 2/8 H=0.250 acc 16/16 | The cat" in drawn and drawn.endswith("\x1b[1A\x1b[1G")
    s.on_canvas(0, ids)
    s.close()
    assert out.getvalue()[len(drawn):] == "\x1b[JThe cat\n"  # erased, then the committed text
