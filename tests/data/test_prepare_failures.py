"""`dgemma data prepare` under bad inputs and faults: every case ends in one DataError (or FileNotFoundError) naming
the path (and line), or is skipped only on request and listed; BPE training stays linear on whitespace-free text.
Offline, like tests/data/test_data.py: corpora are built in tmp_path and pip is never run."""

from __future__ import annotations

import builtins
import errno
import os
import random
import re
import stat
import string
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from dgemma import cli
from dgemma.data import corpus as corpora
from dgemma.data import prepare as pipeline
from dgemma.data import shards as data
from dgemma.data.shards import DataError
from dgemma.data.tokenizer import MAX_TRAINING_WORD_CHARS, bpe_training_texts, toy_corpus, train_bpe_tokenizer
from dgemma.io.console import Log

B = MAX_TRAINING_WORD_CHARS
_PRE = pre_tokenizers.ByteLevel(add_prefix_space=False)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to run a subprocess (pip download?): {args}")
    monkeypatch.setattr(corpora.subprocess, "run", refuse)


def letters(n: int, seed: int) -> str:
    """`n` random lowercase letters: one pre-token, with every letter pair in it."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def words(text: str) -> list[str]:
    """The pre-tokens BPE training counts pairs in (GPT-2's regex), as text."""
    return [text[a:b] for _, (a, b) in _PRE.pre_tokenize_str(text)]


# --- BPE training: over-long pre-tokens are cut, ordinary text is untouched ---------------------------------------

def test_bpe_training_text_is_untouched_without_over_long_pre_tokens():
    at_the_bound = ["x" * B, " " + "y" * (B - 1), "-" * B + " end", " " * B + "x", "\x1c" * B]
    texts = toy_corpus(100) + at_the_bound
    assert list(bpe_training_texts(texts)) == texts


@pytest.mark.parametrize("text", [
    "before " + letters(20 * B + 7, seed=0) + " after",
    "y" * (5 * B),
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
    """Uncut, a line of 100k random letters (one pre-token) trains in quadratic time: 6.4 s at bpe:8192 on a loaded
    2-core machine, and 300k took 65 s. Cut, it is a few hundred pieces of B characters and trains in a fraction of a
    second (no wall-clock assertion: the structure is checked above and here)."""
    line = letters(100_000, seed=1)
    pieces = list(bpe_training_texts([line]))
    assert len(pieces) == -(-len(line) // B) and max(map(len, pieces)) == B
    tok = train_bpe_tokenizer([*toy_corpus(50), line], 1000)
    assert tok.vocab_size == 1000
    assert tok.decode(tok.encode(line, add_special_tokens=False)) == line


# --- bad inputs and faults: one DataError naming the path (and line) ---------------------------------------------

@pytest.fixture
def deny(monkeypatch):
    """deny(path): make `path` unreadable and unwritable. chmod 000, restored afterwards; as root, who ignores
    modes, the calls dgemma makes on it (os.open, os.scandir, open, os.access) fail instead, as for a user."""
    changed: list[tuple[Path, int]] = []

    def apply(path: Path) -> None:
        changed.append((path, path.stat().st_mode))
        path.chmod(0)
        if os.geteuid() != 0:
            return
        denied = os.fspath(path)
        for module, name in ((os, "open"), (os, "scandir"), (builtins, "open")):
            real = getattr(module, name)

            def guarded(p, *args, _real=real, **kwargs):
                if isinstance(p, (str, os.PathLike)) and os.fspath(p) == denied:
                    raise PermissionError(errno.EACCES, "Permission denied", denied)
                return _real(p, *args, **kwargs)
            monkeypatch.setattr(module, name, guarded)
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: os.fspath(p) != denied and real_access(p, mode,
                                                                                                           *a, **k))
    yield apply
    for path, mode in reversed(changed):
        path.chmod(stat.S_IMODE(mode))


@pytest.fixture
def read_only(monkeypatch):
    """read_only(path): chmod 555 (restored afterwards); as root, os.access says it is not writable."""
    changed: list[Path] = []

    def apply(path: Path) -> None:
        changed.append(path)
        path.chmod(0o555)
        if os.geteuid() == 0:
            real_access = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: not (os.fspath(p) == os.fspath(path) and
                                                                            mode & os.W_OK) and real_access(p, mode))
    yield apply
    for path in changed:
        path.chmod(0o755)


def good_corpus(root: Path) -> Path:
    (root / "corpus" / "sub").mkdir(parents=True)
    for i, text in enumerate(toy_corpus(40)[:12]):
        (root / "corpus" / ("sub" if i % 3 == 0 else ".") / f"d{i:02d}.txt").write_text(text)
    return root / "corpus"


def _unreadable_subdirectory(tmp, deny):
    deny(good_corpus(tmp) / "sub")
    return tmp / "corpus"


def _unreadable_file_in_a_directory(tmp, deny):
    deny(good_corpus(tmp) / "d01.txt")
    return tmp / "corpus"


def _unreadable_file(tmp, deny):
    (tmp / "secret.txt").write_text("private")
    deny(tmp / "secret.txt")
    return tmp / "secret.txt"


def _fifo(tmp, deny):
    os.mkfifo(tmp / "pipe.txt")  # no writer: opening it for reading would block
    return tmp / "pipe.txt"


def _fifo_in_a_directory(tmp, deny):
    os.mkfifo(good_corpus(tmp) / "pipe.txt")
    return tmp / "corpus"


def _broken_symlink_in_a_directory(tmp, deny):
    (good_corpus(tmp) / "gone.md").symlink_to(tmp / "nowhere.md")
    return tmp / "corpus"


def _symlink_loop(tmp, deny):
    (tmp / "loop.txt").symlink_to(tmp / "loop.txt")
    return tmp / "loop.txt"


def _dev_null(tmp, deny):
    return Path(os.devnull)


def _missing(tmp, deny):
    return tmp / "missing"


def _lone_surrogate(tmp, deny):
    (tmp / "chat.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "half an emoji \\ud83d here"}\n')
    return tmp / "chat.jsonl"


def _latin1_text(tmp, deny):
    (tmp / "old.txt").write_bytes("line one\nline two\nna\u00efve\n".encode("latin-1"))
    return tmp / "old.txt"


def _latin1_jsonl(tmp, deny):
    (tmp / "old.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n')
    return tmp / "old.jsonl"


BAD_INPUTS = [  # (case, make(tmp, deny) -> PATH, error, message)
    (_unreadable_subdirectory, DataError,
     r"corpus/sub: cannot read \(cannot list the directory: Permission denied\); .*--skip-unreadable"),
    (_unreadable_file_in_a_directory, DataError, r"corpus/d01.txt: cannot read \(Permission denied\); .*--skip-unread"),
    (_unreadable_file, DataError, r"secret.txt: cannot read \(Permission denied\)"),
    (_fifo, DataError, r"pipe.txt: a FIFO \(named pipe\), not a file or directory dgemma data can read"),
    (_dev_null, DataError, r"/dev/null: a character device, not a file or directory"),
    (_fifo_in_a_directory, DataError, r"corpus/pipe.txt: cannot read \(a FIFO \(named pipe\)\)"),
    (_broken_symlink_in_a_directory, DataError, r"corpus/gone.md: cannot read \(a broken symlink to .*nowhere.md\)"),
    (_symlink_loop, DataError, r"loop.txt: a symlink loop"),
    (_missing, FileNotFoundError, r"missing: no such file or directory"),
    (_lone_surrogate, DataError, r"chat.jsonl:2: \"text\" holds a lone surrogate \(U\+D83D at character 14\)"),
    (_latin1_text, DataError, r"old.txt: not valid UTF-8 \(byte 0xef at offset 20, line 3\)"),
    (_latin1_jsonl, DataError, r"old.jsonl: not valid UTF-8 \(byte 0xe9 at offset 41, line 3\)"),
]


def run_prepare(out: Path, path: Path, **kw):
    kw = {"tokenizer": "bpe:300", "val_fraction": 0.2, "quiet": True} | kw
    return pipeline.prepare(out, [str(path)], cache_dir=out.parent / "cache", **kw)


@pytest.mark.parametrize("make, error, message", BAD_INPUTS, ids=[case[0].__name__.strip("_") for case in BAD_INPUTS])
def test_bad_input_is_one_error_naming_it(make, error, message, tmp_path, deny, capsys):
    path = make(tmp_path, deny)
    with pytest.raises(error, match=message):
        run_prepare(tmp_path / "out", path)
    assert not (tmp_path / "out").exists()
    # the command line: the same message on one line, exit status 2
    capsys.readouterr()
    assert cli.main(["data", "prepare", "--out", str(tmp_path / "out"), "--corpus", str(path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_skip_unreadable_leaves_out_and_lists_them(tmp_path, deny):
    root = good_corpus(tmp_path)
    os.mkfifo(root / "pipe.txt")
    deny(root / "d01.txt")
    deny(root / "sub")
    with pytest.raises(DataError, match=r"corpus/d01.txt: cannot read .*\(and 2 more unreadable path\(s\)\)"):
        run_prepare(tmp_path / "out", root)
    result = run_prepare(tmp_path / "out", root, skip_unreadable=True)
    (warning,) = [w for w in result["warnings"] if "unreadable" in w]
    assert "skipped 3 unreadable path(s) (--skip-unreadable)" in warning
    for name in ("d01.txt (Permission denied)", "pipe.txt (a FIFO (named pipe))", "sub (cannot list the directory"):
        assert name in warning
    (source,) = result["meta"]["sources"]
    assert source["skipped_unreadable"] == [str(root / n) for n in ("d01.txt", "pipe.txt", "sub")]
    assert source["files"] == 12 - 4 - 1  # the 4 in sub/ and d01.txt are left out
    assert len(data.decode_documents(tmp_path / "out", "train") + data.decode_documents(tmp_path / "out", "val")) == 7


def test_symlinked_directories_are_followed_and_loops_reported_once(tmp_path):
    root = good_corpus(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "linked.md").write_text("A file in a symlinked directory.")
    (root / "more").symlink_to(tmp_path / "elsewhere")
    (root / "loop").symlink_to(root)  # back to the corpus itself
    (tmp_path / "elsewhere" / "up").symlink_to("../elsewhere")  # back to itself, through the first link
    log = Log(quiet=True)
    source = corpora.read_path(root, log)
    assert "A file in a symlinked directory." in source.documents and len(source.documents) == 13
    loops = [w for w in log.warnings if "symlink loop" in w]
    assert len(loops) == 2 and any("corpus/loop: " in w for w in loops) and any("more/up: " in w for w in loops)


def test_read_only_out_is_refused_before_any_work(tmp_path, read_only, monkeypatch, capsys):
    root = good_corpus(tmp_path)
    run_prepare(tmp_path / "done", root)  # a read-only output that is up to date is only verified: no error
    read_only(tmp_path / "done")
    assert run_prepare(tmp_path / "done", root)["status"] == "up to date"
    (tmp_path / "ro").mkdir()
    read_only(tmp_path / "ro")
    monkeypatch.setattr(pipeline, "_make_tokenizer", lambda *a: pytest.fail("made a tokenizer for a read-only --out"))
    with pytest.raises(DataError, match=r"--out .*ro: it is not writable \(permission denied\)"):
        run_prepare(tmp_path / "ro", root)
    with pytest.raises(DataError, match=r"--out .*ro/new: .*ro, where it would be created, is not writable"):
        run_prepare(tmp_path / "ro" / "new", root)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"--out .*file/new: .*file is not a directory"):
        run_prepare(tmp_path / "file" / "new", root)
    assert cli.main(["data", "prepare", "--out", str(tmp_path / "ro"), "--corpus", str(root), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ro: it is not writable (permission denied)" in err


def test_a_failing_write_is_one_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    root = good_corpus(tmp_path)

    def full_disk(final, content, written):
        raise OSError(errno.ENOSPC, "No space left on device", str(final))
    monkeypatch.setattr(pipeline, "write_temp", full_disk)
    with pytest.raises(DataError, match=r"--out .*out: cannot write .*out/tokenizer.json \(No space left on device\)"):
        run_prepare(tmp_path / "out", root)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # the shards written so far are removed


def test_bad_tokenizer_file_and_cache_directory(tmp_path, deny):
    root = good_corpus(tmp_path)
    os.mkfifo(tmp_path / "tok.json")
    with pytest.raises(DataError, match=r"--tokenizer .*tok.json: not a regular file"):
        run_prepare(tmp_path / "out", root, tokenizer=str(tmp_path / "tok.json"))
    (tmp_path / "secret.json").write_text("{}")
    deny(tmp_path / "secret.json")
    with pytest.raises(DataError, match=r"--tokenizer .*secret.json: cannot read \(Permission denied\)"):
        run_prepare(tmp_path / "out", root, tokenizer=str(tmp_path / "secret.json"))
    (tmp_path / "cache").write_text("a file, not a directory")
    with pytest.raises(DataError, match=r"cache directory .*cache: cannot write \(File exists\); set --cache-dir"):
        pipeline.prepare(tmp_path / "out", ["default"], cache_dir=tmp_path / "cache", quiet=True)
    assert not (tmp_path / "out").exists()
