"""Prepared token data: the directory `dgemma data prepare` writes (dgemma/data/prepare.py), read back for training.

    DIR/meta.json                  written last: the commit point. Counts, tokenizer, sources, licences, checksums
    DIR/tokenizer.json             the tokenizer the shards were made with (Hugging Face format)
    DIR/train-<tag>-00000.bin ...  raw little-endian uint16 token ids (uint32 when the vocabulary needs it),
    DIR/val-<tag>-00000.bin ...    at most `shard_tokens` each; <tag> is the first 8 hex digits of the fingerprint

A split's shards, concatenated in order, are one token stream: every document's tokens followed by the end-of-text
id (`meta["eot_id"]`), so decoding the stream and cutting it at that id gives back the documents byte for byte.
`ShardWriter` writes shards under a temporary name and renames them when complete; `load_meta` and `verify` check a
directory against its meta.json.

`TokenDataset(DIR, split)` memory-maps a split for training: `windows(seq_len, shift)` are consecutive,
non-overlapping windows of `seq_len` tokens (shift=0, the diffusion objective) or `seq_len + 1` (shift=1, the
autoregressive baseline's inputs plus targets), `batches(...)` a seeded shuffle of them that can resume at any batch
index, and `heldout_batches(...)` the same windows in order, for evaluation.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgemma.data.tokenizer import Tokenizer, load_tokenizer
from dgemma.io import fsio

FORMAT = "dgemma-token-shards"
FORMAT_VERSION = 1  # in the fingerprint: bump when the layout, the split or a reader changes, to re-prepare
SPLITS = ("train", "val")
_SHARD_NAME = re.compile(r"^(train|val)-[0-9a-f]{8}-\d{5}\.bin$")
_TEMP_NAME = re.compile(r"^\.(train|val|tokenizer|meta).*\.tmp$")


class DataError(ValueError):
    """A corpus, tokenizer or prepared directory that cannot be used; the message names the file. A ValueError, so
    `dgemma` prints it on one line and exits 2."""


MAX_JSON_DEPTH = 64  # nesting of one JSON row of a data file: a chat with tool calls needs under ten
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal, escapes included


def parse_json_row(text: str, where: str, error: type[DataError] = DataError) -> Any:
    """One JSON value of a data file (a JSONL line: a corpus record, a chat), or DataError naming `where` (the file
    and line): invalid JSON, nesting deeper than MAX_JSON_DEPTH (measured before parsing, so a line of 100k `[`s is
    an error, not a RecursionError), or a string holding a lone surrogate (a "\\ud800" escape is valid JSON but not
    Unicode text, and would fail later, when it is encoded). The one reader of JSON rows, for every data file;
    `error`: the DataError subclass to raise (sft's ChatDataError)."""
    brackets = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), dtype=np.uint8)
    steps = (np.isin(brackets, (ord("["), ord("{"))).astype(np.int32)
             - np.isin(brackets, (ord("]"), ord("}"))).astype(np.int32))
    depth = int(np.cumsum(steps).max()) if steps.size else 0
    if depth > MAX_JSON_DEPTH:
        raise error(f"{where}: JSON nested {depth} levels deep; a data row may nest at most {MAX_JSON_DEPTH}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    bad = _lone_surrogate(value, "")
    if bad is not None:
        field, string, at = bad
        raise error(f"{where}: {json.dumps(field or 'the value')} holds a lone surrogate (U+{ord(string[at]):04X} "
                    f"at character {at}), which is not valid Unicode text; fix the \\u escape")
    return value


def _lone_surrogate(value: Any, field: str) -> tuple[str, str, int] | None:
    """(the field, the string, the index) of the first string in `value`, a key or a value, that is not encodable
    as UTF-8 (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return field, value, e.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else key
        found = (_lone_surrogate(key, name) if isinstance(key, str) else None) or _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()



def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65,536), else uint32; always little-endian on disk."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")



# --- shards ---------------------------------------------------------------------------------------------------

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
        tmp = write_temp(final, data, self.written)
        self.written.append(final)
        os.replace(tmp, final)


def write_temp(final: Path, data: bytes, written: list[Path]) -> Path:
    """Write `data` under a hidden temporary name beside `final`, flushed to disk, so that renaming it to `final`
    publishes a complete file; the name goes into `written` first, for clean-up."""
    tmp = fsio.temp_name(final)  # unique, created exclusively, never through a symlink
    written.append(tmp)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def clean_stray_files(directory: Path, keep: set[str]) -> None:
    """Remove temporaries of interrupted runs and shards no meta.json lists (from a run killed before its commit).
    Only dgemma's own file-name patterns are touched: DIR may hold other files."""
    for path in directory.iterdir():
        if (_TEMP_NAME.match(path.name) or _SHARD_NAME.match(path.name)) and path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)


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
    _check_file_names(path, meta)
    if np.dtype(meta["dtype"]) not in (np.dtype("<u2"), np.dtype("<u4")):
        raise DataError(f"{path}: dtype {meta['dtype']!r}; shards are uint16 or uint32")
    if meta["vocab_size"] > int(np.iinfo(np.dtype(meta["dtype"])).max) + 1:
        raise DataError(f"{path}: vocab_size {meta['vocab_size']:,} does not fit {np.dtype(meta['dtype']).name} "
                        "shards; re-prepare (ids that large need uint32)")
    return meta


def _check_file_names(path: Path, meta: dict[str, Any]) -> None:
    """Every file meta.json names (the tokenizer, each shard) is a plain file name inside its directory
    (dgemma/io/fsio.py's rule, the one checkpoint shards follow): DataError naming the key otherwise."""
    tokenizer, splits = meta["tokenizer"], meta["splits"]
    if not isinstance(tokenizer, dict) or not isinstance(splits, dict):
        raise DataError(f"{path}: 'tokenizer' and 'splits' must be objects")
    named = [("tokenizer.file", tokenizer.get("file"))]
    for split, entry in splits.items():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            raise DataError(f"{path}: splits.{split}.shards must be a list of shard objects")
        named += [(f"splits.{split}.shards[{i}].file", s.get("file")) for i, s in enumerate(shards)]
    for key, name in named:
        problem = fsio.plain_name_problem(name)
        if problem:
            raise DataError(f"{path}: {key}: {problem}; meta.json names files by plain names inside {path.parent}")


def verify(directory: str | os.PathLike[str], meta: dict[str, Any] | None = None, checksums: bool = True,
           splits: tuple[str, ...] = SPLITS) -> None:
    """Check the tokenizer and every shard of `splits` against meta.json: present, the right size, and (with
    `checksums`) the recorded sha256. The first mismatch is a DataError naming the file. Training verifies both
    splits, `dgemma eval` the validation split it reads."""
    directory = Path(directory)
    meta = meta or load_meta(directory)
    tok = directory / meta["tokenizer"]["file"]
    if not tok.is_file():
        raise DataError(f"{tok}: missing (listed in meta.json)")
    if sha256_file(tok) != meta["tokenizer"]["sha256"]:
        raise DataError(f"{tok}: sha256 does not match meta.json (changed after prepare, or an interrupted "
                        "re-prepare); run dgemma data prepare again")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, split in meta["splits"].items():
        if name not in splits:
            continue
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


def check_token_range(directory: str | os.PathLike[str], vocab_size: int, meta: dict[str, Any] | None = None,
                      block: int = 1 << 22, splits: tuple[str, ...] = SPLITS) -> None:
    """Every token id in every shard is < `vocab_size` (what the model can embed): a DataError naming the first shard
    with an id out of range, instead of an IndexError in the middle of training. Reads the shards in blocks."""
    directory = Path(directory)
    meta = meta or load_meta(directory)
    dtype = np.dtype(meta["dtype"])
    for name, split in meta["splits"].items():
        if name not in splits:
            continue
        for shard in split["shards"]:
            path = directory / shard["file"]
            tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.empty(0, dtype)
            for start in range(0, len(tokens), block):
                top = int(tokens[start:start + block].max())
                if top >= vocab_size:
                    at = start + int(np.argmax(tokens[start:start + block] >= vocab_size))
                    raise DataError(f"{path}: token id {int(tokens[at]):,} at position {at:,} is out of range for "
                                    f"a vocabulary of {vocab_size:,} (a damaged shard, or data prepared with another "
                                    "tokenizer); re-run dgemma data prepare")


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

    def batches(self, batch_size: int, seq_len: int, seed: int, start_batch: int = 0, shift: int = 0,
                rank: int = 0, world_size: int = 1) -> Iterator[torch.Tensor]:
        """An endless stream of (batch_size, seq_len + shift) LongTensors: the windows in a fresh seeded order each
        epoch, epochs back to back (a batch may straddle two). Batch k depends only on (seed, k), so a run resumed
        with start_batch=k sees exactly the batches an uninterrupted run would.

        With `world_size` W > 1 (distributed training), batch k is global: the W * batch_size windows a single
        process with batch W * batch_size reads as its batch k, and this `rank` gets rows [rank * batch_size,
        (rank + 1) * batch_size) of it. Ranks read disjoint windows, and what a step sees depends on the seed and
        the step alone, not on how many ranks share it."""
        windows = self._nonempty_windows(batch_size, seq_len, shift)
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size), got rank {rank!r} of world_size {world_size!r}")
        if not (isinstance(seed, int) and seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not (isinstance(start_batch, int) and start_batch >= 0):
            raise ValueError(f"start_batch must be a non-negative integer, got {start_batch!r}")

        def stream() -> Iterator[torch.Tensor]:
            n, epoch, order = len(windows), -1, np.empty(0, dtype=np.int64)
            # index into the concatenation of all epochs' orders
            position = (start_batch * world_size + rank) * batch_size
            while True:
                rows = []
                for p in range(position, position + batch_size):
                    e, i = divmod(p, n)
                    if e != epoch:
                        epoch, order = e, np.random.default_rng([seed, e]).permutation(n)
                    rows.append(windows[int(order[i])])
                position += batch_size * world_size
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


def token_counts(directory: str | os.PathLike[str], vocab_size: int | None = None) -> np.ndarray:
    """How often each token id occurs in the training split (V,) int64; V the data's vocabulary, or `vocab_size` (a
    model's, which may be larger)."""
    train = TokenDataset(directory, "train")
    return np.bincount(train.read(0, train.num_tokens), minlength=vocab_size or int(train.meta["vocab_size"]))


def unigram_log_probs(directory: str | os.PathLike[str], vocab_size: int | None = None) -> np.ndarray:
    """log p of each token id under the training split's add-one unigram (V,) float64 (`token_counts`' V: ids a
    larger model vocabulary adds get the add-one count)."""
    counts = token_counts(directory, vocab_size).astype(np.float64) + 1
    return np.log(counts / counts.sum())


def unigram_cross_entropy(directory: str | os.PathLike[str]) -> float:
    """Held-out cross-entropy (nats/token) of the training split's unigram distribution (add-one smoothed) on the
    validation split: what a model that ignores every context scores, the reference line of a learning curve."""
    val = TokenDataset(directory, "val")
    logp = unigram_log_probs(directory)
    held = val.read(0, val.num_tokens)
    if held.size == 0:
        raise DataError(f"{directory}: the validation split is empty; prepare with --val-fraction > 0")
    return float(-logp[held].mean())


__all__ = ["FORMAT", "DataError", "ShardWriter", "TokenDataset", "Windows", "decode_documents", "inspect_dataset",
           "load_meta", "sha256_file", "token_counts", "token_dtype", "unigram_cross_entropy", "unigram_log_probs",
           "verify"]
