"""Bad inputs, round two (issue 21, inputs slice): bounded batch files, numeric flags checked at parse time (argparse's
own error, on one line), float settings within float32, one seed rule, LoRA settings against the model, one JSON row
reader for data files, the BPE vocabulary bound, eval's checks of its data and judge, the split warning, and the
chunked tokenisation of large documents (the same ids as the whole document)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.data.shards import DataError, parse_json_row
from dgemma.data.tokenizer import build_test_tokenizer, toy_corpus
from dgemma.model.config import ConfigError
from dgemma.sampling.generation_config import SEED_MAX, GenerationConfig, is_seed

TINY = dgemma.preset("tiny")  # vocab 512, hidden 64, k_proj 64 -> 32
RANDOM = ["--preset", "tiny", "--random-init"]
FAST = ["--max-denoising-steps", "2", "--max-new-tokens", "16"]
CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def error_line(capsys, argv: list[str]) -> str:
    """Run the real CLI in-process; assert exit 2 and exactly one stderr line `dgemma CMD: error: ...` (argparse's
    errors included: they exit through SystemExit(2)); return that line."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.match(rf"dgemma {argv[0]}( {argv[1]})?: error: ", lines[0]), lines[0]  # argparse: `dgemma data prepare`
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny random checkpoint with the test tokenizer (512 ids): what `finetune --model` and `eval` read."""
    path = tmp_path_factory.mktemp("base") / "tiny"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), path)
    build_test_tokenizer(512, path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Prepared data (bpe:300 on the toy corpus, 30% held out) that the tiny model can read."""
    from dgemma.data.prepare import prepare

    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in toy_corpus(60)))
    prepare(root / "out", [str(corpus)], tokenizer="bpe:300", val_fraction=0.3, quiet=True)
    return root / "out"


# --- numeric flags: argparse's own error at parse time, one line, before anything is read or written ---------------

def _deep_jsonl(t: Path) -> str:
    (t / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return str(t / "deep.jsonl")


def _many_prompts(t: Path) -> str:
    (t / "many.txt").write_text("".join(f"prompt {i}\n" for i in range(5000)))
    return str(t / "many.txt")


def _big_batch_file(t: Path) -> str:
    with open(t / "big.txt", "wb") as f:
        f.truncate((1 << 24) + 1)  # one byte over 16 MiB (sparse)
    return str(t / "big.txt")


PARSE_CASES = [
    ("train --minutes nan", lambda t: ["train", "--data", str(t), "--out", str(t / "run"), "--minutes", "nan"],
     r"argument --minutes: expected a finite number .*'nan'"),
    ("train --minutes 0", lambda t: ["train", "--data", str(t), "--out", str(t / "run"), "--minutes", "0"],
     r"argument --minutes: must be a finite number > 0, got '0'"),
    ("train --until-step -1", lambda t: ["train", "--data", str(t), "--out", str(t / "run"), "--until-step", "-1"],
     r"argument --until-step: must be a positive integer \(>= 1\), got '-1'"),
    ("train --seed 2**64", lambda t: ["train", "--data", str(t), "--out", str(t / "run"), "--seed", str(2**64)],
     r"argument --seed: must be an int from 0 to 4294967295 \(2\*\*32 - 1\), got '18446744073709551616'"),
    ("finetune --minutes inf", lambda t: ["finetune", "--model", str(t), "--data", str(t / "c.jsonl"), "--out",
                                          str(t / "run"), "--minutes", "inf"],
     r"argument --minutes: expected a finite"),
    ("generate --seed 2**70", lambda t: ["generate", *RANDOM, "--prompt-ids", "2", "--seed", str(2**70), *FAST],
     r"argument --seed: must be an int from 0 to 4294967295 \(2\*\*32 - 1\)"),
    ("demo --minutes inf", lambda t: ["demo", "--minutes", "inf", "--out", str(t / "demo")],
     r"argument --minutes: expected a finite number .*'inf'"),
    ("demo --minutes nan", lambda t: ["demo", "--minutes", "nan", "--out", str(t / "demo")],
     r"argument --minutes: expected a finite number .*'nan'"),
    ("bench --prompt-length -1", lambda t: ["bench", "--prompt-length", "-1"],
     r"argument --prompt-length: must be a positive integer \(>= 1\), got '-1'"),
    ("eval --ar-temperatures nan", lambda t: ["eval", "--model", str(t), "--data", str(t), "--out", str(t / "r"),
                                              "--ar-temperatures", "1,nan"],
     r"argument --ar-temperatures: expected a finite"),
    ("data prepare --shard-tokens 0", lambda t: ["data", "prepare", "--out", str(t / "o"), "--shard-tokens", "0"],
     r"argument --shard-tokens: must be a positive integer"),
    ("viz --row -1", lambda t: ["viz", str(t / "trace"), "--out", str(t / "pics"), "--row", "-1"],
     r"argument --row: must be an integer >= 0"),
    ("inspect --parallel pp=2", lambda t: ["inspect", "--preset", "tiny", "--parallel", "pp=2"],
     r"argument --parallel: 'pp=2': unknown key 'pp'"),
    ("inspect --parallel ep=0", lambda t: ["inspect", "--preset", "tiny", "--parallel", "ep=0"],
     r"argument --parallel: 'ep=0': ep must be an integer >= 1, got 0"),
    ("inspect --parallel ep:4", lambda t: ["inspect", "--preset", "tiny", "--parallel", "ep:4"],
     r"argument --parallel: 'ep:4': expected ep=K, tp=K, ep\+tp=K"),
    ("inspect --batch 0", lambda t: ["inspect", "--preset", "tiny", "--parallel", "ep=2", "--batch", "0"],
     r"argument --batch: must be a positive integer \(>= 1\), got '0'"),
]


@pytest.mark.parametrize("name,argv,message", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_a_bad_number_is_argparses_one_line_error_before_anything_is_written(tmp_path, capsys, name, argv, message):
    before = sorted(tmp_path.rglob("*"))
    line = error_line(capsys, argv(tmp_path))
    assert re.search(message, line), line
    assert sorted(tmp_path.rglob("*")) == before  # no .lock, no run.json, no output directory


# --- errors of the command that runs: one line, exit 2 --------------------------------------------------------------

def _surrogate_chat(t: Path) -> str:
    bad = {"messages": [{"role": "user", "content": "Hi \ud83d there"}, {"role": "assistant", "content": "Hello"}]}
    (t / "c.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps(bad) + "\n")  # json.dumps escapes it: \ud83d
    return str(t / "c.jsonl")


def _deep_chat(t: Path) -> str:
    (t / "c.jsonl").write_text(json.dumps(CHAT) + '\n{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return str(t / "c.jsonl")


def _chats(t: Path) -> str:
    (t / "c.jsonl").write_text((json.dumps(CHAT) + "\n") * 4)
    return str(t / "c.jsonl")


RUN_CASES = [
    ("generate --t-max 4e38", lambda t, b: ["generate", *RANDOM, "--prompt-ids", "2", "--t-max", "4e38", *FAST],
     r"t_max: must be a finite number within float32's range .*got 4e\+38"),
    ("generate --batch-file over 16 MiB", lambda t, b: ["generate", *RANDOM, "--batch-file", _big_batch_file(t)],
     r"big\.txt: cannot read \(larger than the 16,777,216 bytes allowed"),
    ("generate --batch-file of 5000 prompts", lambda t, b: ["generate", *RANDOM, "--batch-file", _many_prompts(t)],
     r"many\.txt: 5,000 prompts; one batch takes at most 4,096"),
    ("data prepare on JSONL nested 100k deep",
     lambda t, b: ["data", "prepare", "--out", str(t / "o"), "--corpus", _deep_jsonl(t), "--tokenizer", "bpe:300"],
     r"deep\.jsonl:1: JSON nested 100001 levels deep; a data row may nest at most 64"),
    ("finetune on a chat nested 100k deep",
     lambda t, b: ["finetune", "--model", str(b), "--data", _deep_chat(t), "--out", str(t / "run")],
     r"c\.jsonl line 2: JSON nested 100001 levels deep"),
    ("finetune on a lone surrogate in a chat",
     lambda t, b: ["finetune", "--model", str(b), "--data", _surrogate_chat(t), "--out", str(t / "run")],
     r"c\.jsonl line 2: \"messages\[0\]\.content\" holds a lone surrogate \(U\+D83D at character 3\)"),
    ("finetune --lora-rank 100000",
     lambda t, b: ["finetune", "--model", str(b), "--data", _chats(t), "--out", str(t / "run"), "--lora-rank",
                   "100000"],
     r"lora_rank: 100000 exceeds the width of the narrowest adapted layer \(layers\.0\.self_attn\.k_proj: 32\)"),
    ("finetune --lora-alpha 0",
     lambda t, b: ["finetune", "--model", str(b), "--data", _chats(t), "--out", str(t / "run"), "--lora-rank", "4",
                   "--lora-alpha", "0"], r"lora_alpha: must be > 0"),
    ("finetune --lora-alpha -1",
     lambda t, b: ["finetune", "--model", str(b), "--data", _chats(t), "--out", str(t / "run"), "--lora-rank", "4",
                   "--lora-alpha", "-1"], r"lora_alpha: must be > 0 .*got -1"),
]


@pytest.mark.parametrize("name,argv,message", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_bad_input_is_one_line_and_exit_2(base, tmp_path, capsys, name, argv, message):
    args = argv(tmp_path, base)
    line = error_line(capsys, args)
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("argv,message", [
    # /dev/zero was read whole (22.8 GB, then the OOM killer); the Rust BPE trainer aborted the process
    (["generate", *RANDOM, "--batch-file", "/dev/zero"], r"--batch-file /dev/zero: cannot read \(a character device"),
    (["data", "prepare", "--out", "OUT", "--corpus", "CORPUS", "--tokenizer", "bpe:1000000000"],
     r"--tokenizer bpe:1000000000: a byte-level BPE's vocab_size must be from 261 .* to 1,048,576, got 1,000,000,000"),
], ids=["batch-file /dev/zero", "bpe:1000000000"])
def test_inputs_that_killed_the_process_are_one_line(tmp_path, argv, message):
    (tmp_path / "corpus.txt").write_text("Some text to prepare.\n")
    argv = [a.replace("OUT", str(tmp_path / "o")).replace("CORPUS", str(tmp_path / "corpus.txt")) for a in argv]
    p = subprocess.run([sys.executable, "-m", "dgemma", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"dgemma {argv[0]}: error: ") and re.search(message, p.stderr), p.stderr


# --- the library rules the command line and the server share ---------------------------------------------------------

@pytest.mark.parametrize("field,value", [("t_max", 1e308), ("t_max", 4e38), ("entropy_bound", 1e39),
                                         ("confidence_threshold", -1e300), ("t_min", float("nan"))])
def test_every_float_setting_must_fit_float32(field, value):
    with pytest.raises(ConfigError, match=rf"{field}: must be a finite number within float32's range"):
        GenerationConfig().replace(**{field: value})
    assert GenerationConfig(t_max=3e38).t_max == 3e38  # the largest float32 values are accepted


def test_the_server_refuses_t_max_1e308_naming_the_field():
    from dgemma.serving.api import APIError, parse_completion_request

    tok = build_test_tokenizer(512)
    with pytest.raises(APIError, match=r"t_max: must be a finite number within float32's range"):
        parse_completion_request({"model": "m", "prompt": "Hello", "t_max": 1e308}, tokenizer=tok,
                                 base_config=GenerationConfig(), model_name="m")


def test_one_seed_rule_and_64_bit_training_seeds():
    from dgemma.train.config import TrainConfig
    from dgemma.train.loop import micro_step_generator

    assert is_seed(0) and is_seed(SEED_MAX) and not is_seed(-1) and not is_seed(SEED_MAX + 1) and not is_seed(True)
    with pytest.raises(ConfigError, match=r"TrainConfig\.seed: must be an int from 0 to 4294967295 \(2\*\*32 - 1\)"):
        TrainConfig(seed=2**64)
    # the largest seed derives every micro-step's generator (seed * 1_000_003 + m overflowed torch.Generator)
    g = micro_step_generator(TrainConfig(seed=SEED_MAX), 7, torch.device("cpu"))
    assert g.initial_seed() == (SEED_MAX * 1_000_003 + 7) % 2**64


def test_the_largest_seed_derives_per_prompt_seeds():
    """eval's decoding loops seed prompt i with seed + i, which overflowed torch.Generator at the largest seed."""
    from dgemma.eval.decoding import run_ar, run_sampler
    from dgemma.sampling.generation_config import offset_seed

    assert offset_seed(SEED_MAX, 2) == 1 and offset_seed(5, 2) == 7
    model = dgemma.init_weights(dgemma.DiffusionGemma(TINY)).eval()
    prompts = [torch.tensor([2, 45, 7]), torch.tensor([2, 9])]
    config = GenerationConfig(max_new_tokens=16, max_denoising_steps=2)
    assert len(run_sampler(model, prompts, config, seed=SEED_MAX, progress=False).samples) == 2
    assert len(run_ar(model, prompts, max_new_tokens=4, eos=(), seed=SEED_MAX, progress=False).samples) == 2


def test_lora_rank_is_checked_against_the_narrowest_adapted_layer():
    from dgemma.weights.lora import check_adapter

    check_adapter(32, 16.0, "attention", TINY)  # k_proj and v_proj are 64 -> 32: rank 32 is their full rank
    with pytest.raises(ConfigError, match=r"lora_rank: 33 exceeds .*k_proj: 32\); use a rank from 1 to 32"):
        check_adapter(33, 16.0, "attention", TINY)
    with pytest.raises(ConfigError, match=r"lora_alpha: must be > 0"):
        check_adapter(4, 0.0, "attention+experts", TINY)


def test_json_rows_are_bounded_and_unicode():
    assert parse_json_row('{"a": [[{"b": "[[[[\\"["}]]}', "f:1") == {"a": [[{"b": '[[[["['}]]}  # in strings
    assert parse_json_row("[" * 64 + "]" * 64, "f:1") is not None
    with pytest.raises(DataError, match=r"^f:1: JSON nested 65 levels deep"):
        parse_json_row("[" * 65 + "]" * 65, "f:1")
    with pytest.raises(DataError, match=r'^f:3: "meta\.tags\[1\]" holds a lone surrogate \(U\+DC00 at character 1\)'):
        parse_json_row('{"text": "ok", "meta": {"tags": ["a", "x\\udc00"]}}', "f:3")
    with pytest.raises(DataError, match=r"^f:2: not valid JSON"):
        parse_json_row('{"text": ', "f:2")


# --- eval: the data it reads is verified, the judge is autoregressive -------------------------------------------------

@pytest.fixture(scope="module")
def model_of_data(base, data, tmp_path_factory) -> Path:
    """The tiny checkpoint with the data's tokenizer: a diffusion model (no train_config.json) `eval` accepts."""
    import shutil

    path = tmp_path_factory.mktemp("eval") / "tiny"
    shutil.copytree(base, path)
    shutil.copyfile(data / "tokenizer.json", path / "tokenizer.json")
    return path


def test_eval_verifies_the_validation_shard_checksum(model_of_data, data, tmp_path, capsys):
    import shutil

    damaged = tmp_path / "data"
    shutil.copytree(data, damaged)
    meta = json.loads((damaged / "meta.json").read_text())
    shard = damaged / meta["splits"]["val"]["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01  # a flipped bit: the size is right, the ids are still in range
    shard.write_bytes(bytes(raw))
    line = error_line(capsys, ["eval", "--model", str(model_of_data), "--data", str(damaged), "--out",
                               str(tmp_path / "r"), "--quiet"])
    assert re.search(rf"{re.escape(str(shard))}: checksum mismatch", line), line
    assert not (tmp_path / "r").exists()


def test_eval_refuses_a_diffusion_checkpoint_as_the_judge(model_of_data, data, tmp_path, capsys):
    line = error_line(capsys, ["eval", "--model", str(model_of_data), "--judge", str(model_of_data), "--data",
                               str(data), "--out", str(tmp_path / "r"), "--quiet"])
    assert re.search(rf"--judge {re.escape(str(model_of_data))} has no .*train_config\.json to show it was trained "
                     r"autoregressively; the judge must be an autoregressive run \(objective 'ar'", line), line


# --- the split, and large documents in pieces ------------------------------------------------------------------------

def test_a_split_decided_by_one_large_document_warns_once(tmp_path):
    from dgemma.data.prepare import prepare

    (tmp_path / "big.txt").write_text("word " * 20_000)
    for i in range(3):
        (tmp_path / f"small{i}.txt").write_text(f"a small document number {i}\n")
    files = [str(tmp_path / f) for f in ("big.txt", "small0.txt", "small1.txt", "small2.txt")]
    result = prepare(tmp_path / "o", files, tokenizer="bpe:300", val_fraction=0.95, quiet=True)
    (warning,) = [w for w in result["warnings"] if "--val-fraction" in w]
    assert re.search(r"--val-fraction 0\.95: the split is by whole document and gives validation \d+\.\d\d% of the "
                     r"text and training \d+\.\d\d% \(asked: 95\.00% / 5\.00%\); the largest document is 99\.\d\d% of "
                     r"the corpus", warning), warning
    even = [tmp_path / f"even{i}.txt" for i in range(10)]
    for i, path in enumerate(even):
        path.write_text(f"document {i} " + "text " * 50)
    balanced = prepare(tmp_path / "o2", [str(p) for p in even], tokenizer="bpe:300", val_fraction=0.2, quiet=True)
    assert not [w for w in balanced["warnings"] if "--val-fraction" in w]


def test_a_large_document_in_pieces_gives_the_whole_documents_ids():
    from tokenizers import pre_tokenizers

    from dgemma.data.prepare import encode_documents
    from dgemma.data.tokenizer import bpe_training_texts, text_chunks, train_bpe_tokenizer

    sentences = toy_corpus(300)
    text = "".join(s + ("\n" if i % 3 == 0 else " ") for i, s in enumerate(sentences))  # prose: lines of sentences
    tok = train_bpe_tokenizer(sentences, 400)
    tok.backend.encode_special_tokens = True
    pieces = list(text_chunks(text, 64))
    assert "".join(pieces) == text and len(pieces) > 100 and max(map(len, pieces)) <= 64
    blocks = list(encode_documents(tok, [text, "short one", text[:500]], eot_id=1, piece_chars=64, block_chars=200))
    assert len(blocks) > 10 and sum(size for _, size in blocks) == len(text) + len("short one") + 500
    whole = [i for doc in (text, "short one", text[:500]) for i in [*tok.encode(doc, add_special_tokens=False), 1]]
    assert np.concatenate([ids for ids, _ in blocks]).tolist() == whole
    # BPE training sees the same pre-tokens in pieces, so it learns the same merges
    gpt2_regex = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = lambda t: [w for w, _ in gpt2_regex.pre_tokenize_str(t)]
    assert [w for p in bpe_training_texts([text], chunk_chars=64) for w in words(p)] == words(text)


def test_bench_checks_the_memory_a_batch_needs_before_allocating_it(capsys):
    """`bench --batch 1000000000` asked the allocator for 96 GB and died with its traceback (tests/cli/test_fuzz_cli.py
    found it); the memory pre-flight now refuses it in one line, naming what it needs."""
    assert cli.main(["bench", "--preset", "tiny", "--denoising-steps", "1", "--canvases", "1", "--repeats", "1",
                     "--no-train", "--batch", "1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"dgemma bench: error: needs about [\d.]+ GB \(", err[0]), err
