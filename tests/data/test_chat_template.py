"""One chat-template system (serving/templates.ChatTemplate) for `dgemma chat`, `generate --chat`, serve and
fine-tuning: a checkpoint's own `chat_template.jinja` is what `dgemma chat` and `generate --chat` render (in
jinja2's sandbox), and a multi-turn session continues the cache with that template's text after an answer."""

from __future__ import annotations

import io
import json
import re

import pytest

import dgemma
from dgemma import cli
from dgemma.data.templates import ChatTemplate, load_chat_template
from dgemma.data.tokenizer import encode_template, load_tokenizer
from dgemma.serving.chat import ChatSession

pytest.importorskip("jinja2")
TINY = dgemma.preset("tiny")
FAST = {"max_denoising_steps": 2, "max_new_tokens": 16}
# Its own turn markers (plain text to the toy tokenizer), so what it renders cannot be the built-in Gemma template.
OWN = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }} [end]\n{% endfor %}"
       "{% if add_generation_prompt %}[assistant] {% endif %}")


def checkpoint(tmp_path, tok_path, template: str):
    ckpt = tmp_path / "ckpt"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), ckpt)
    (ckpt / "tokenizer.json").write_bytes(tok_path.read_bytes())
    (ckpt / "chat_template.jinja").write_text(template)
    return ckpt


def test_dgemma_chat_renders_the_checkpoints_template(tmp_path, tok_path, capsys, monkeypatch):
    ckpt = checkpoint(tmp_path, tok_path, "{{ raise_exception('the checkpoint template rendered this turn') }}")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert cli.main(["chat", "--model", str(ckpt), "--max-denoising-steps", "2", "--max-new-tokens", "16",
                     "--seed", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(r"dgemma chat: error: chat template \(.*chat_template\.jinja\): the checkpoint template "
                        r"rendered this turn", err[0]), err[0]


def test_generate_chat_encodes_the_checkpoints_template(tmp_path, tok_path, capsys):
    ckpt = checkpoint(tmp_path, tok_path, OWN)
    assert cli.main(["generate", "--model", str(ckpt), "--prompt", "Hello", "--chat", "--json", "--seed", "0",
                     "--max-denoising-steps", "2", "--max-new-tokens", "16"]) == 0
    rec = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(tok_path)
    assert tok.decode(rec["prompt_ids"]) == "<bos>[user] Hello [end]\n[assistant] "


def test_a_session_continues_the_cache_in_its_template(tmp_path, tok_path):
    tok = load_tokenizer(tok_path)
    template = load_chat_template(checkpoint(tmp_path, tok_path, OWN))
    model = dgemma.init_weights(dgemma.DiffusionGemma(TINY)).eval()
    session = ChatSession(model, tok, seed=1, template=template, **FAST)
    assert tok.decode(session.prompt_ids("Hi")) == "<bos>[user] Hi [end]\n[assistant] "
    session.reply("Hi")
    committed, pending = session.cache.length, list(session.pending)
    ids = session.prompt_ids("Why?")
    assert ids == pending + encode_template(tok, " [end]\n[user] Why? [end]\n[assistant] ")
    session.reply("Why?")
    assert session.cache.length > committed  # the second turn followed the first in the same cache


def test_a_template_that_rewrites_history_gets_the_conversation_whole(tok_path):
    """A template that renders only the last user turn cannot be continued: the conversation is encoded again."""
    tok = load_tokenizer(tok_path)
    last_only = ChatTemplate("{{ bos_token }}{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}",
                             origin="last-only")
    assert last_only.continuation([{"role": "user", "content": "Hi"}], "Why?") is None
    model = dgemma.init_weights(dgemma.DiffusionGemma(TINY)).eval()
    session = ChatSession(model, tok, seed=1, template=last_only, **FAST)
    session.reply("Hi")
    assert tok.decode(session.prompt_ids("Why?")) == "<bos>Why?>"
    session.reply("Why?")
    assert session.messages[-2] == {"role": "user", "content": "Why?"}


def test_a_template_past_the_render_limits_on_every_conversation_is_refused_when_it_loads(tmp_path, tok_path,
                                                                                           capsys):
    """`{{ 'x' * 100000000 }}` used to render 100 MB for every request (a server at 15 GB, tokenizing it): the
    sandbox refuses it before it is made, and a template that passes a render limit on the plainest conversation is
    refused when it loads, by `dgemma serve` in one line (exit 2)."""
    from dgemma.data.templates import ChatTemplateError

    ckpt = checkpoint(tmp_path, tok_path, "{{ bos_token }}{{ 'x' * 100000000 }}")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: unusable chat template: .* passed a render "
                                                r"limit: '\*' would make a value of ~100,000,000 characters"):
        load_chat_template(ckpt)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"own\.jinja: unusable .*: rendering took longer than 2 s"):
        ChatTemplate(loops, origin="own.jinja")
    assert cli.main(["serve", "--model", str(ckpt), "--port", "0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("dgemma serve: error: ") and "unusable chat template" in err[0], err
