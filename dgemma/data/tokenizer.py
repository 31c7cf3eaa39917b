"""Tokenizers and the Gemma chat template.

`load_tokenizer(path)` reads a Hugging Face `tokenizer.json` (the released checkpoints ship one) with the
`tokenizers` library; `Tokenizer` is a thin wrapper with the few methods dgemma needs. `format_chat` renders
the Gemma 4 turn template, which DiffusionGemma inherits:

    <bos><|turn>system\\n{system}<turn|>\\n        (only when the first message is a system message)
    <|turn>user\\n{content}<turn|>\\n
    <|turn>model\\n{content}<turn|>\\n              (earlier model turns)
    <|turn>model\\n                                (add_generation_prompt)

`build_test_tokenizer(vocab_size, path)` trains a small byte-level BPE on built-in English sentences, so toy
models (vocab 512) can be driven with text, offline. `train_bpe_tokenizer(texts, vocab_size)` trains the same kind
on a real corpus, and `build_gpt2_tokenizer(encoder_json, vocab_bpe)` builds the exact GPT-2 BPE from OpenAI's two
files (checked by sha256); `dgemma.data.shards` uses both to turn text into token shards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _HFTokenizer

from dgemma.io import fsio

BOS, TURN_START, TURN_END = "<bos>", "<|turn>", "<turn|>"
TEST_SPECIAL_TOKENS = ("<pad>", "<eos>", BOS, TURN_START, TURN_END)  # ids 0..4, as Gemma's pad=0, eos=1, bos=2
# OpenAI's GPT-2 files, as tiktoken pins them (tiktoken_ext/openai_public.py): encoder.json is the vocabulary,
# vocab.bpe the merges.
GPT2_FILE_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
                    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
GPT2_EOT = "<|endoftext|>"  # id 50256, the last of GPT-2's 50,257
ROLES = {"user": "user", "model": "model", "assistant": "model", "system": "system"}
# BPE training counts pairs inside pre-tokens ("words"), and merging a pair in a word of n symbols costs O(n) per
# occurrence, so one huge word (a 300k-character line without whitespace) makes training quadratic. For training only,
# a pre-token longer than this many characters is cut into pieces of at most this many (see `bpe_training_texts`).
# Ordinary text never has such words, so its merges are unchanged; the saved tokenizer encodes any text as before.
MAX_TRAINING_WORD_CHARS = 256
TEXT_CHUNK_CHARS = 1 << 17  # a longer document is trained on and encoded in pieces (text_chunks): memory per piece
MAX_BPE_VOCAB = 1 << 20  # 1,048,576 ids: 4x Gemma's 262,144; beyond it the trainer's allocations abort the process


class Tokenizer:
    """A `tokenizers.Tokenizer` with dgemma's small interface."""

    def __init__(self, backend: _HFTokenizer, source: str = "<memory>"):
        self.backend, self.source = backend, source
        # The largest id + 1, not get_vocab_size(): added tokens may leave gaps, and what must fit the model's
        # embedding table is the largest id.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.bos_id = backend.token_to_id(BOS)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor runs (Gemma's and the
        test tokenizer's prepend <bos>)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Ids the tokenizer does not know (a model vocabulary larger than the tokenizer's) are
        dropped; incomplete UTF-8 byte sequences become U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in the tokenizer's byte-level decoding, so that a token holding part of a
        UTF-8 character gives those bytes (its decoded text alone is U+FFFD) and the bytes of a run of tokens join
        into their text's: a byte-level BPE token through GPT-2's byte alphabet, a byte-fallback token <0xHH> as that
        byte, `▁` as a space (SentencePiece's metaspace, Gemma's); any other token (a special one) as its text."""
        raw = self.backend.id_to_token(token_id)
        if raw is None:
            return b""
        kinds, special = self._decoding
        if token_id in special:
            return raw.encode("utf-8")
        if "ByteLevel" in kinds and all(c in _UNICODE_TO_BYTE for c in raw):
            return bytes(_UNICODE_TO_BYTE[c] for c in raw)
        if "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", raw):
            return bytes([int(raw[3:5], 16)])
        if "Replace" in kinds or "Metaspace" in kinds:
            return raw.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id]).encode("utf-8")

    @functools.cached_property
    def _decoding(self) -> tuple[set[str], set[int]]:
        """The types of the tokenizer's decoders (a Sequence's members included), read once from its JSON, and the
        special tokens' ids."""
        spec = json.loads(self.backend.to_str()).get("decoder") or {}
        return {d.get("type") for d in [spec, *spec.get("decoders", [])]}, set(self.special_tokens())

    def special_tokens(self) -> dict[int, str]:
        """The special added tokens: id -> text (the chat markers, EOS, padding)."""
        added = self.backend.get_added_tokens_decoder()
        return {i: self.backend.id_to_token(i) or "" for i, t in added.items() if t.special}


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load `path` (a tokenizer.json, or a directory holding one). Missing: FileNotFoundError; unreadable or
    not a tokenizer: ValueError. Both name the file."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        where = f"{path} has no tokenizer.json" if path.is_dir() else f"{file}: no such tokenizer file"
        raise FileNotFoundError(where)
    fsio.check_regular(file)  # a FIFO or a directory is refused by name (dgemma/io/fsio.py), never read
    try:
        backend = _HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON or an unknown model type
        raise ValueError(f"{file}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
    return Tokenizer(backend, source=str(file))


def check_vocab(tokenizer: Tokenizer, model_config: Any) -> None:
    """Raise ValueError if the tokenizer can produce ids the model has no embedding for. A smaller tokenizer is
    fine: Gemma pads its embedding table beyond the tokenizer's vocabulary."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.source} has {tokenizer.vocab_size:,} ids but the model's vocab_size "
                         f"is {model_config.vocab_size:,}: ids >= {model_config.vocab_size:,} have no embedding "
                         "(wrong tokenizer for this model?)")


def format_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render `messages` ({"role": "user"|"model"|"assistant"|"system", "content": str}) with the Gemma 4 template
    (see the module docstring). As Gemma's Jinja template: content is stripped, "assistant" is written "model",
    and a system message is allowed only first."""
    out = [BOS]
    for i, m in enumerate(messages):
        role = ROLES.get(m.get("role", ""))
        if role is None:
            raise ValueError(f"message {i}: unknown role {m.get('role')!r}; use one of {', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise ValueError(f"message {i}: a system message must come first")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string, got {type(content).__name__}")
        out.append(f"{TURN_START}{role}\n{content.strip()}{TURN_END}\n")
    if add_generation_prompt:
        out.append(f"{TURN_START}model\n")
    return "".join(out)


def encode_template(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode template text whose control tokens are written out (<bos>, <|turn>, <turn|>). The post-processor is
    off so <bos> is not added twice; control tokens the tokenizer lacks are left as plain text, except <bos>,
    which is dropped (a tokenizer without one, such as GPT-2's, has no beginning-of-sequence token)."""
    if tokenizer.bos_id is None and text.startswith(BOS):
        text = text[len(BOS):]
    return tokenizer.encode(text, add_special_tokens=False)


# --- a tiny offline tokenizer for toy models and tests ---------------------------------------------------------

_SUBJECTS = ("The cat", "A dog", "My friend", "The teacher", "Our team", "The old man", "A small bird", "The river",
             "Every student", "The farmer", "Her brother", "The little girl", "A tired traveler", "The doctor",
             "The young king", "Our neighbor", "The quiet child", "A clever fox", "The captain", "My grandmother")
_VERBS = ("sees", "likes", "finds", "carries", "watches", "remembers", "paints", "opens", "follows", "builds",
          "cleans", "writes about", "talks about", "walks toward", "looks for", "thinks about", "dreams of", "answers")
_OBJECTS = ("the red ball", "a quiet garden", "the long road home", "an open window", "the morning light",
            "a warm cup of tea", "the blue sky", "a heavy wooden box", "the northern mountains", "a new bicycle",
            "the kitchen table", "an important letter", "the green field", "a bright yellow flower", "the busy market",
            "a simple question", "the evening train", "an old photograph", "the cold water", "a difficult problem")
_TAILS = ("", " today", " every morning", " after lunch", " in the rain", " with great care", " before dinner",
          " at night", " once again", " without a word", " near the sea", " for a long time")
_EXTRA = ("Hello! How are you today?", "I am fine, thank you. And you?", "What is the capital of France?",
          "The capital of France is Paris.", "Can you help me with my homework?", "Yes, of course. What do you need?",
          "One, two, three, four, five, six, seven, eight, nine, ten.", "0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024",
          "Please write a short poem about the sea.", "Why is the sky blue? Because of scattered sunlight.",
          "user\n", "model\n", "system\n", "Thanks for your help.")


def left_pad(rows: list[list[int]], pad_id: int, device: Any = None) -> tuple[Any, Any]:
    """(B, T) token ids of `rows` left-padded with `pad_id`, and their attention mask (1 = token, 0 = padding), or
    None for the mask when no row is padded: generate()'s `input_ids` and `attention_mask` for a batch of prompts."""
    import torch

    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (T - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, (None if bool(mask.all()) else mask)


def toy_corpus(n: int = 400) -> list[str]:
    """`n` + 14 deterministic English sentences (subject, verb, object, adverbial, cycled with coprime strides)."""
    out = list(_EXTRA)
    for i in range(n):
        out.append(f"{_SUBJECTS[i % len(_SUBJECTS)]} {_VERBS[(i * 7) % len(_VERBS)]} "
                   f"{_OBJECTS[(i * 11 + i // 20) % len(_OBJECTS)]}{_TAILS[(i * 5) % len(_TAILS)]}.")
    return out


def write_toy_corpus(directory: str | os.PathLike[str], documents: int = 150) -> Path:
    """`toy_corpus(120)` as a folder of text documents (what `dgemma data prepare --corpus DIR` reads): document i is
    sentences 7i .. 7i + 11 (cyclically), so held-out documents share the training text's sentences, and 150 of them
    hold enough held-out text for a few windows of `cpu-small`'s 128 tokens. The smoke modes of runs/ and the test of
    the documented commands train on it. Returns `directory`."""
    out, sentences = Path(directory), toy_corpus(120)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (out / f"d{i:03d}.txt").write_text(" ".join(sentences[(7 * i + j) % len(sentences)] for j in range(12)))
    return out


# A pre-token longer than MAX_TRAINING_WORD_CHARS holds a run of that many characters that the pre-tokenizer (Rust's
# Unicode \s) counts as non-space (Python's \S, plus \x1c-\x1f, which Python but not Rust calls space), or is a
# longer run of whitespace. A text without such a run is passed to the trainer untouched.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable bytes as themselves, the others as 256 + k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_alphabet()


def text_chunks(text: str, max_chars: int = TEXT_CHUNK_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `max_chars` characters (the text itself when it is that short), so a
    large document is trained on and encoded a piece at a time: the tokenizer's per-token structures for a 16 MB
    document took 2.7 GB. Each cut is where GPT-2's pre-tokenizer regex (the byte-level BPEs', bpe:N and gpt2)
    splits anyway, so the pieces' pre-tokens, and so their token ids, are the whole text's: after a newline or before
    a space, each between two non-whitespace characters (the newline is a pre-token of its own, the space starts the
    next word's), in the second half of the piece, the last such place. A piece with no such place (half a chunk
    without a lone space or newline) is cut at `max_chars`, and there the ids may differ; so may they at every cut for
    a tokenizer.json with another pre-tokenizer."""
    start, n = 0, len(text)
    while n - start > max_chars:
        end = _cut(text, start + max_chars // 2, start + max_chars)
        yield text[start:end]
        start = end
    yield text[start:]


def _cut(text: str, lo: int, hi: int) -> int:
    """The last cut in (lo, hi] that keeps the pre-tokens whole (see text_chunks), else hi."""
    for char, after in (("\n", 1), (" ", 0)):  # a newline cut first: pieces end at line ends where they can
        i = text.rfind(char, lo, hi)
        while i > lo:
            if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
                return i + after
            i = text.rfind(char, lo, i)
    return hi


def bpe_training_texts(texts: Iterable[str], max_word: int = MAX_TRAINING_WORD_CHARS,
                       chunk_chars: int = TEXT_CHUNK_CHARS) -> Iterator[str]:
    """`texts` as BPE training sees them: each in pieces of at most `chunk_chars` characters (`text_chunks`: cut
    between pre-tokens, so the pre-tokens the trainer counts are the same, and its memory follows the piece, not the
    document); a piece whose pre-tokens (GPT-2's regex) are all at most `max_word` characters is yielded as it is;
    any other is yielded in pieces, cut only inside its over-long pre-tokens, every `max_word` characters from the
    pre-token's start. The pieces concatenate to the text, each pre-token of a piece is at most `max_word`
    characters, and the other pre-tokens are the text's own (cuts fall strictly inside a pre-token, and GPT-2's
    regex looks ahead one character at most), so the trainer's work stays linear in the input while ordinary text
    trains exactly as before."""
    pattern = re.compile(rf"[\S\x1c-\x1f]{{{max_word},}}|\s{{{max_word + 1},}}")  # re caches the compiled form
    for text in (piece for whole in texts for piece in text_chunks(whole, chunk_chars)):
        if not pattern.search(text):
            yield text
            continue
        cuts = [c for _, (a, b) in _BYTE_LEVEL.pre_tokenize_str(text) if b - a > max_word
                for c in range(a + max_word, b, max_word)]
        for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
            yield text[start:end]


def check_bpe_vocab(vocab_size: int, special: int = len(TEST_SPECIAL_TOKENS)) -> None:
    """A byte-level BPE's vocabulary size must hold the 256 bytes and the `special` tokens, and be at most
    MAX_BPE_VOCAB (the trainer allocates by the requested size up front: bpe:1000000000 aborts the process in Rust).
    ValueError otherwise, saying what is accepted."""
    minimum = special + 256
    if not minimum <= vocab_size <= MAX_BPE_VOCAB:
        raise ValueError(f"a byte-level BPE's vocab_size must be from {minimum} ({special} special tokens + 256 "
                         f"bytes) to {MAX_BPE_VOCAB:,}, got {vocab_size:,}")


def _train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...], *,
                          length: int | None = None, show_progress: bool = False) -> _HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer regex, the 256 byte symbols always in the vocabulary, so any text
    encodes without an unknown token) trained on `texts`, `special_tokens` at ids 0, 1, ... Pre-tokens longer than
    MAX_TRAINING_WORD_CHARS are cut for training (`bpe_training_texts`), so training time is linear in the input."""
    check_bpe_vocab(vocab_size, len(special_tokens))
    backend = _HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  show_progress=show_progress, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(bpe_training_texts(texts), trainer=trainer, length=length)
    return backend


def build_test_tokenizer(vocab_size: int, path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenizer, every byte representable) on `toy_corpus()`, with
    <pad>=0, <eos>=1, <bos>=2, <|turn>=3, <turn|>=4 and a post-processor that prepends <bos>, as Gemma's does.
    Deterministic. The corpus supports about 720 ids; a larger `vocab_size` yields that many. Writes `path`
    (a .json file, or a directory that gets a tokenizer.json) when given."""
    backend = _train_byte_level_bpe(toy_corpus(), vocab_size, TEST_SPECIAL_TOKENS)
    bos = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                           special_tokens=[(BOS, bos)])
    source = "<test tokenizer>"
    if path is not None:
        file = Path(path) if Path(path).suffix == ".json" else Path(path) / "tokenizer.json"
        file.parent.mkdir(parents=True, exist_ok=True)
        backend.save(str(file))
        source = str(file)
    return Tokenizer(backend, source=source)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, length: int | None = None,
                        show_progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids on `texts` (deterministic for the same texts in the same
    order), with the test tokenizer's special tokens <pad>=0, <eos>=1, <bos>=2, <|turn>=3, <turn|>=4: Gemma's
    pad/eos/bos ids, and the turn markers so the chat template encodes. No post-processor: `encode` gives the text's
    tokens only, exactly what `dgemma.data.shards` writes between <eos> separators. A corpus with few distinct pairs
    yields fewer ids than `vocab_size`."""
    backend = _train_byte_level_bpe(texts, vocab_size, TEST_SPECIAL_TOKENS, length=length,
                                    show_progress=show_progress)
    return Tokenizer(backend, source=f"<bpe:{vocab_size}>")


def build_gpt2_tokenizer(encoder_json: bytes, vocab_bpe: bytes, source: str = "<gpt2>") -> Tokenizer:
    """The exact GPT-2 BPE (50,257 ids, <|endoftext|> = 50256) from OpenAI's `encoder.json` and `vocab.bpe`
    contents. Each is checked against its pinned sha256 first (ValueError naming the file on a mismatch), so the
    ids are the published ones: "Hello world" -> [15496, 995]. The layout matches the Hugging Face gpt2
    tokenizer.json: byte-level pre-tokenizer and decoder, no prefix space, no <bos>."""
    for name, data in (("encoder.json", encoder_json), ("vocab.bpe", vocab_bpe)):
        digest = hashlib.sha256(data).hexdigest()
        if digest != GPT2_FILE_SHA256[name]:
            raise ValueError(f"{source}: {name} has sha256 {digest}, not GPT-2's {GPT2_FILE_SHA256[name]}")
    vocab = json.loads(encoder_json)
    # vocab.bpe: a "#version: 0.2" header, then one merge per line, "left right" (byte-level symbols hold no spaces)
    merges = [tuple(line.split(" ")) for line in vocab_bpe.decode("utf-8").splitlines()[1:] if line]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(GPT2_EOT, special=True)])
    return Tokenizer(backend, source=source)


__all__ = ["MAX_TRAINING_WORD_CHARS", "Tokenizer", "bpe_training_texts", "build_gpt2_tokenizer", "build_test_tokenizer",
           "check_vocab", "encode_template", "format_chat", "load_tokenizer", "toy_corpus", "train_bpe_tokenizer",
           "write_toy_corpus"]
