"""Tokenizer, chat template, and the `generate` / `chat` commands' own work (parsing, prompts, JSON, errors,
streaming), run for real on tiny random models; tests/cli/test_cli.py checks their output against the library."""

from __future__ import annotations

import io
import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.cli.generate import Streamer
from dgemma.data.templates import ChatTemplate
from dgemma.data.tokenizer import (
    build_test_tokenizer,
    check_vocab,
    encode_template,
    format_chat,
    load_tokenizer,
)

TINY = dgemma.preset("tiny")  # vocab 512, canvas 16, pad 0, eos 1, bos 2
L = TINY.canvas_length


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
    with pytest.raises(ValueError, match="vocab_size must be from 261"):
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


def test_builtin_template_single_bos_and_control_ids(tok):
    ids = ChatTemplate(None).encode(tok, [{"role": "user", "content": "Hello"}])
    assert ids[:2] == [2, 3] and ids.count(2) == 1  # one <bos>, not two
    assert ids.count(3) == 2 and ids.count(4) == 1  # <|turn> twice, <turn|> once: one id each
    assert tok.decode(ids) == format_chat([{"role": "user", "content": "Hello"}])
    # The chat history built turn by turn is the template of the whole conversation.
    first = ChatTemplate(None).encode(tok, [{"role": "user", "content": "Hi"}])
    answer = tok.encode("Hello!", add_special_tokens=False)
    whole = ChatTemplate(None).encode(tok, [{"role": "user", "content": "Hi"}, {"role": "model", "content": "Hello!"},
                                 {"role": "user", "content": "Why?"}])
    follow = ChatTemplate(None).continuation([{"role": "user", "content": "Hi"}], "Why?")
    assert first + answer + encode_template(tok, follow) == whole


def test_check_vocab(tok):
    check_vocab(tok, TINY)
    check_vocab(tok, TINY.replace(vocab_size=1024))  # a smaller tokenizer is fine (Gemma pads the embedding)
    with pytest.raises(ValueError, match=r"512 ids but the model's vocab_size is 300"):
        check_vocab(tok, TINY.replace(vocab_size=300))


# --- the CLI, for real (tests/cli/test_cli.py runs generate and chat end to end) ------------------------------------

RANDOM = ["--preset", "tiny", "--random-init"]


def test_generate_json_chat_from_model_dir(tok, tok_path, tmp_path, capsys):
    model, ckpt = dgemma.init_weights(dgemma.DiffusionGemma(TINY)), tmp_path / "ckpt"
    dgemma.save_pretrained(model, ckpt, generation_config=dgemma.GenerationConfig(eos_token_id=(1, 4), pad_token_id=0))
    (ckpt / "tokenizer.json").write_bytes(tok_path.read_bytes())  # found next to the weights
    assert cli.main(["generate", "--model", str(ckpt), "--prompt", "Hello", "--chat", "--json", "--seed", "0",
                     "--max-denoising-steps", "2", "--max-new-tokens", "32", "--trace", str(tmp_path / "t.npz")]) == 0
    out, _ = capsys.readouterr()
    (line,) = out.splitlines()  # --json: nothing but one object per prompt on stdout
    rec = json.loads(line)
    assert set(rec) == {"prompt", "prompt_ids", "text", "token_ids", "tokens_per_forward", "steps_per_canvas",
                        "stop_reasons"}
    assert rec["prompt"] == "Hello"
    assert rec["prompt_ids"] == ChatTemplate(None).encode(tok, [{"role": "user", "content": "Hello"}])
    assert rec["text"] == tok.decode(rec["token_ids"], skip_special_tokens=True)
    ids = rec["token_ids"]
    assert all(0 <= i < 512 for i in ids) and not any(i in (1, 4) for i in ids[:-1])  # nothing after an EOS
    canvases = len(rec["steps_per_canvas"])
    assert canvases == len(rec["stop_reasons"]) and 1 <= canvases <= 2 and len(ids) <= canvases * L
    assert (tmp_path / "t.npz").is_file() and (tmp_path / "t.json").is_file()


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
def test_generate_bad_input(capsys, tmp_path, argv, message):
    if "BIG" in argv:
        build_test_tokenizer(600, tmp_path / "big.json")
    argv = [str(tmp_path / "big.json") if a == "BIG" else str(tmp_path / "x.json") if a == "MISSING" else a
            for a in argv]
    assert cli.main(["generate", *RANDOM, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgemma generate: error: ") and len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_generate_needs_weights(capsys, tmp_path):
    assert cli.main(["generate", "--preset", "tiny", "--prompt-ids", "5"]) == 2
    assert "add --random-init" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path / "none"), "--prompt-ids", "5"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_chat_needs_tokenizer(capsys, monkeypatch):
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
