"""`dgemma data prepare` under bad inputs and faults: every case ends in one DataError (or FileNotFoundError) naming
the path (and line), or is skipped only on request and listed; BPE training stays linear on whitespace-free text.
Offline, like tests/test_data.py: corpora are built in tmp_path and pip is never run."""

from __future__ import annotations

import random
import string

import pytest
from tokenizers import pre_tokenizers

from dgemma import corpus as corpora
from dgemma.tokenizer import MAX_TRAINING_WORD_CHARS, bpe_training_texts, toy_corpus, train_bpe_tokenizer

B = MAX_TRAINING_WORD_CHARS
_PRE = pre_tokenizers.ByteLevel(add_prefix_space=False)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to run a subprocess (pip download?): {args}")
    monkeypatch.setattr(corpora.subprocess, "run", refuse)


def words(text: str) -> list[str]:
    """The pre-tokens BPE training counts pairs in (GPT-2's regex), as text."""
    return [text[a:b] for _, (a, b) in _PRE.pre_tokenize_str(text)]


# --- BPE training: over-long pre-tokens are cut, ordinary text is untouched ---------------------------------------

def test_bpe_training_text_is_untouched_without_over_long_pre_tokens():
    at_the_bound = ["x" * B, " " + "y" * (B - 1), "-" * B + " end", " " * B + "x", "\x1c" * B]
    texts = toy_corpus(100) + at_the_bound
    assert list(bpe_training_texts(texts)) == texts


@pytest.mark.parametrize("text", [
    "before " + "".join(random.Random(0).choice(string.ascii_lowercase) for _ in range(20 * B + 7)) + " after",
    "digits " + "7" * (3 * B) + ", spaces " + " " * (2 * B + 3) + "x and " + "!?" * B,
    "emoji " + "\U0001F600" * (B + 1) + " ok",
    "\x1c" * (2 * B) + " separators: a space to Python, not to the pre-tokenizer",
])
def test_bpe_training_cuts_over_long_pre_tokens_only(text):
    pieces = list(bpe_training_texts([text]))
    assert "".join(pieces) == text and len(pieces) > 1
    got = [w for piece in pieces for w in words(piece)]
    assert max(map(len, got)) <= B
    # exactly the text's own pre-tokens, the over-long ones cut every B characters from their start
    assert got == [w[i:i + B] for w in words(text) for i in range(0, len(w), B)]


def test_bpe_training_on_a_long_line_without_whitespace():
    """A 100k-character line of letters (one pre-token) took about 10 s to train on before the cut (quadratic: 300k
    took 65 s); now it is a few hundred pieces of B characters and trains in well under a second."""
    line = "".join(random.Random(1).choice(string.ascii_lowercase) for _ in range(100_000))
    pieces = list(bpe_training_texts([line]))
    assert len(pieces) == -(-len(line) // B) and max(map(len, pieces)) == B
    tok = train_bpe_tokenizer([*toy_corpus(50), line], 1000)
    assert tok.vocab_size > 261 + 300  # merges were learned (random letters support about 730 ids, cut or not)
    assert tok.decode(tok.encode(line, add_special_tokens=False)) == line
