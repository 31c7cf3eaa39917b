"""Real text: how much of a sample is words of the corpus, measured so that degenerate text fails
(docs/evaluation.md section 3).

    vocabulary(data_dir)                      the words of the training split (decoding.words of each document)
    real_text_share(text, vocabulary)         share of the text's characters that lie in a vocabulary word
    floors(data_dir, tokenizer, ...)          the same share for held-out text and for two kinds of noise of the same
                                              length: i.i.d. draws from the training split's unigram, uniform tokens

The share counts characters, not words: every character of the text, spaces, line breaks and punctuation included, is
in the denominator, and only the letters of words found in the vocabulary are in the numerator. A text of newlines
and punctuation scores 0, word salad of sub-word pieces scores what its accidental words cover, and fluent prose
scores about 0.8 (its spaces and punctuation are the rest). A counted-words share (decoding.real_word_share, `dgemma
demo`) scored 74% for unigram noise and 47% for uniform tokens on the cpu-small data, so a figure means something
only beside its floors: `floors` measures them in the same run, on samples as long as the scored ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dgemma.data.shards import TokenDataset, decode_documents, token_counts
from dgemma.eval.decoding import WORD
from dgemma.eval.paired import mean_se

REAL_TEXT_RULE = ("share of the sample's characters (spaces, line breaks and punctuation included) that lie in a "
                  "word of the training split's vocabulary")


def vocabulary(data_dir: Any) -> set[str]:
    """The lower-cased words of every document of the training split."""
    return {m.group(0).lower() for doc in decode_documents(data_dir, "train") for m in WORD.finditer(doc)}


def real_text_share(text: str, vocab: set[str]) -> float:
    """Characters of `text` inside words (`decoding.WORD`) of `vocab`, over all its characters; NaN for ''."""
    if not text:
        return math.nan
    inside = sum(len(m.group(0)) for m in WORD.finditer(text) if m.group(0).lower() in vocab)
    return inside / len(text)


def shares(tokenizer: Any, samples: Sequence[Sequence[int]], vocab: set[str]) -> list[float]:
    """`real_text_share` of each sample's text (special tokens dropped)."""
    return [real_text_share(tokenizer.decode(list(s), skip_special_tokens=True), vocab) for s in samples]


def floors(data_dir: Any, tokenizer: Any, vocab: set[str], *, count: int, length: int, seed: int = 0,
           share: Callable[[str], float] | None = None) -> dict[str, Any]:
    """`real_text_share` (or `share`, another measure of one text: `dgemma demo`'s word share) as mean and SE over
    `count` texts of `length` tokens each, of: held-out text (`count` evenly spaced stretches of the validation
    split), i.i.d. samples from the training split's unigram distribution (separators included, as the stream has
    them), and uniform random token ids: the reference and the two floors a sample's share is read against."""
    train, val = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    vocab_size = int(train.meta["vocab_size"])
    rng = np.random.default_rng(seed)
    counts = token_counts(data_dir, vocab_size).astype(np.float64)
    unigram = rng.choice(vocab_size, size=(count, length), p=counts / counts.sum())
    uniform = rng.integers(0, vocab_size, size=(count, length))
    stream = val.read(0, val.num_tokens)
    step = max((stream.size - length) // max(count, 1), 1)
    heldout = [stream[i * step:i * step + length] for i in range(count) if i * step + length <= stream.size]

    def measure(rows: Any) -> dict[str, Any]:
        if share is not None:
            return mean_se([share(tokenizer.decode([int(t) for t in r], skip_special_tokens=True)) for r in rows])
        return mean_se(shares(tokenizer, [[int(t) for t in r] for r in rows], vocab))

    return {"rule": REAL_TEXT_RULE, "length": length, "count": count, "heldout_text": measure(heldout),
            "unigram_floor": measure(unigram), "uniform_floor": measure(uniform),
            "unigram": "i.i.d. draws from the training split's token frequencies",
            "uniform": f"token ids uniform on 0..{vocab_size - 1}"}


__all__ = ["REAL_TEXT_RULE", "floors", "real_text_share", "shares", "vocabulary"]
