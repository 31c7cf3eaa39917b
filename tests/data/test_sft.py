"""Fine-tuning on chats (dgemma/data/sft.py, train/diffusion.py:sft_loss, `dgemma finetune`): the loss covers exactly
the answer tokens of a hand-built conversation; a packed training pass computes what commit + denoise compute at
sampling time; bad chat files fail with one error naming file, line and field; a tiny checkpoint written by
transformers, fine-tuned through the real CLI on a fixed question -> answer mapping, answers its training prompts
through `dgemma chat`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dgemma
from dgemma import cli
from dgemma.data.sft import ChatData, ChatDataError, Example, build_examples, collate, pack, sft_masks
from dgemma.data.templates import ChatTemplate
from dgemma.data.tokenizer import TURN_END, build_test_tokenizer, encode_template
from dgemma.diffusion.noise import q_sample
from dgemma.train.config import TrainConfig
from dgemma.train.diffusion import sample_canvas_t, sft_loss
from dgemma.train.loop import train
from tests.helpers import random_model

ROOT = Path(__file__).resolve().parents[2]
TINY = dgemma.preset("tiny")  # canvas 16, sliding window 8, vocab 512, pad 0
QA = [("What is the capital of France?", "The capital of France is Paris."),
      ("What does the cat see?", "The cat sees the red ball."),
      ("Why is the sky blue?", "Because of scattered sunlight."),
      ("Can you help me with my homework?", "Yes, of course.")]


@pytest.fixture(scope="module")
def tok():
    return build_test_tokenizer(512)


def write_chats(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def qa_chats(path: Path) -> Path:
    return write_chats(path, [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random DiffusionGemma checkpoint written by transformers, with the test tokenizer."""
    from dgemma.testing.hf import build_hf_checkpoint

    path = tmp_path_factory.mktemp("base")
    build_hf_checkpoint(TINY, path, seed=0)
    build_test_tokenizer(512, path)
    return path


def test_loss_masks_exactly_the_answer_tokens(tmp_path, tok):
    long_answer = "One, two, three, four, five, six, seven."  # 28 tokens + <turn|>: two canvases of 16
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you today?"},
            {"role": "assistant", "content": "I am fine, thank you."},
            {"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": long_answer}]
    examples, end = build_examples(write_chats(tmp_path / "c.jsonl", [chat]), tok, ChatTemplate(None))
    assert end == tok.token_to_id(TURN_END)
    assert len(examples) == 2  # one per assistant turn
    for ex, upto, answer in ((examples[0], 2, "I am fine, thank you."), (examples[1], 4, long_answer)):
        # what `dgemma chat` commits: the generation prompt
        assert ex.prompt == ChatTemplate(None).encode(tok, chat[:upto])
        assert ex.response == [*tok.encode(answer, add_special_tokens=False), end]
    second = examples[1]
    assert second.canvases(16) == 2 and len(second.response) > 16
    assert (len(examples[0].prompt), len(second.prompt)) == (42, 76)

    L, S = 16, 144  # 42 + 76 prompt tokens and a clean answer canvas: 134
    batch = collate(examples, pack(examples, [0, 1], L, S), L, S, pad_id=0)
    assert batch.x0.shape == (1, S)  # both fit one row: 3 canvases, 2 prompts + one clean answer canvas
    mask = batch.loss_mask[0]
    assert batch.x0[0][mask].tolist() == examples[0].response + second.response  # exactly the answer tokens
    assert int(mask.sum()) == batch.tokens == len(examples[0].response) + len(second.response)
    # The clean stream: prompt 1, prompt 2 and the second answer's first canvas (its context for canvas 1).
    P1, P2 = len(examples[0].prompt), len(second.prompt)
    assert batch.clean[0, :P1 + P2 + L].tolist() == examples[0].prompt + second.prompt + second.response[:L]
    assert (batch.clean_seg[0, P1 + P2 + L:] == -1).all()
    # Canvases start right after each prompt, at the positions sampling gives them.
    assert batch.noisy_pos[0, :L].tolist() == list(range(P1, P1 + L))
    assert batch.noisy_pos[0, L:3 * L].tolist() == list(range(P2, P2 + 2 * L))

    # The loss is the cross-entropy of the x0 prediction at exactly those positions: replay the step's draws (noise
    # levels, corruption) from its seed and score every canvas position by hand.
    model = random_model("tiny")
    out = sft_loss(model, batch, self_conditioning_prob=0.0, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    t = sample_canvas_t(1, S // L, 16, g)
    xt = q_sample(batch.x0, t, 16, L, 512, g)
    level = torch.cat([torch.zeros(1, S), (t.float() / 16).repeat_interleave(L, 1)], 1)
    with torch.no_grad():
        hidden = model.sequence_hidden(torch.cat([batch.clean, xt], 1), batch.positions,
                                       sft_masks(batch, L, TINY.sliding_window), num_clean=S, t=level)
        per_token = F.cross_entropy(model.logits(hidden[0, S:]), batch.x0[0], reduction="none")
    assert out.tokens == len(examples[0].response) + len(second.response)
    torch.testing.assert_close(out.loss, per_token[mask].mean(), rtol=1e-6, atol=0)
    assert abs(float(per_token.mean()) - float(out.loss.detach())) > 1e-3  # the pad tail would change it


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_packed_pass_equals_commit_then_denoise(impl):
    """Each answer canvas of a packed row gets the logits that committing its prompt and earlier canvases and then
    denoising it give (sliding window 8 < prompt lengths, so sliding layers are exercised)."""
    model = random_model("tiny", seed=1)
    model.impl = impl
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, 500, (n,), generator=g).tolist()
    examples = [Example(rand(11), rand(20), "a"), Example(rand(7), rand(5), "b"), Example(rand(3), rand(17), "c")]
    L, S = 16, 64
    batch = collate(examples, pack(examples, [0, 1, 2], L, S), L, S, pad_id=0)
    assert batch.x0.shape[0] == 2  # a+b in one row, c in the next
    xt = torch.randint(0, 512, batch.x0.shape, generator=g)
    with torch.no_grad():
        hidden = model.sequence_hidden(torch.cat([batch.clean, xt], 1), batch.positions,
                                       sft_masks(batch, L, TINY.sliding_window), num_clean=S)
        logits = model.logits(hidden[:, S:])
    row, off = 0, 0
    for i, ex in enumerate(examples):
        if i == 2:
            row, off = 1, 0
        for k in range(ex.canvases(L)):
            cache = model.new_cache(1, 64)
            model.commit(torch.tensor([ex.prompt + ex.response[:k * L]]), cache)
            expected = model.denoise(xt[row:row + 1, off:off + L], cache)
            torch.testing.assert_close(logits[row:row + 1, off:off + L], expected, rtol=0, atol=2e-4)
            off += L


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not valid JSON"),
    ('{"text": "hello"}', "line 2: field 'messages' must be a non-empty list"),
    ('{"messages": [{"content": "hi"}]}', "line 2: messages[0]: field 'role' is missing"),
    ('{"messages": [{"role": "user"}]}', "line 2: messages[0]: field 'content' is missing"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2: messages[0]: field 'content' must be a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: field 'messages' has no assistant message"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "' + "word " * 60 + '"}]}',
     "line 2, messages[1]: conversation longer than the context"),
])
def test_bad_chat_lines_name_file_line_and_field(tmp_path, tok, line, message):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
                    + line + "\n")
    with pytest.raises(ChatDataError, match=re.escape(f"{path} {message}")):
        ChatData(path, tok, ChatTemplate(None), canvas_length=16, seq_len=32, max_positions=4096, pad_id=0)


def test_cli_refuses_a_bad_chat_file_in_one_line(tmp_path, base, capsys):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    assert cli.main(["finetune", "--model", str(base), "--data", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} line 1: field 'messages' has no assistant message" in err[0]
    assert not (tmp_path / "run").exists()


def test_sft_resume_is_bit_exact(tmp_path, base):
    """3 steps, stop, 3 more: the same weights as 6 steps straight (full fine-tuning and LoRA)."""
    chats = qa_chats(tmp_path / "qa.jsonl")
    for rank in (0, 4):
        cfg = TrainConfig(init_from=str(base), objective="sft", seq_len=64, batch_size=2, max_steps=6, lr=3e-3,
                          warmup_steps=2, eval_every=100, eval_batches=1, save_every=100, log_every=100,
                          lora_rank=rank, lora_targets="attention+experts")
        straight, split = tmp_path / f"straight{rank}", tmp_path / f"split{rank}"
        with open(os.devnull, "w") as quiet:
            train(cfg, chats, straight, stream=quiet)
            train(cfg, chats, split, until_step=3, stream=quiet)
            train(cfg, chats, split, resume=True, stream=quiet)
        a, b = dgemma.load_model(straight), dgemma.load_model(split)
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), name
        start = dgemma.load_model(base)
        assert not torch.equal(a.layers[0].self_attn.q_proj.weight, start.layers[0].self_attn.q_proj.weight)


@pytest.mark.integration
def test_finetuned_tiny_model_answers_its_training_prompts(tmp_path, base):
    """The real CLI: `dgemma finetune` a transformers-written tiny checkpoint on four question -> answer chats, then
    `dgemma chat` answers each question with its answer (the held-out loss falls from ~6.7 to under 0.1)."""
    chats = qa_chats(tmp_path / "qa.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "dgemma", "finetune", "--model", str(base), "--data", str(chats),
                           "--out", str(run), "--seq-len", "64", "--batch-size", "4", "--lr", "5e-3", "--min-lr",
                           "5e-4", "--max-steps", "200", "--eval-every", "200", "--save-every", "200",
                           "--eval-batches", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    evals = [json.loads(line)["val_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in line]
    assert evals[0] > 5 and evals[-1] < 0.1, evals
    questions = "".join(f"{q}\n/reset\n" for q, _ in QA)
    done = subprocess.run([sys.executable, "-m", "dgemma", "chat", "--model", str(run), "--seed", "0"],
                          input=questions, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [a for _, a in QA]


def test_answers_are_cut_with_the_checkpoints_jinja_template(tmp_path, tok):
    """A checkpoint's own template decides the prompt and the answer's end (here a ChatML-style one)."""
    source = ("{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|turn>assistant\n{% endif %}")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]
    examples, end = build_examples(write_chats(tmp_path / "c.jsonl", [chat]), tok, ChatTemplate(source))
    assert examples[0].prompt == encode_template(tok, "<|turn>user\nHi<turn|>\n<|turn>assistant\n")
    assert examples[0].response == encode_template(tok, "Hello<turn|>") and end == examples[0].response[-1]
