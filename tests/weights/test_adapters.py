"""Many LoRA adapters on one base model (dgemma/weights/adapters.py, dgemma/model/adapter_rows.py): in one commit /
denoise pass each row runs its own adapter or the base; an adapted row computes what the adapter merged into the base
(`lora.merge`) computes on that row alone, to rounding; over one-row caches (the engine's continuous batching) a row
without an adapter is bit-identical to the same pass without adapters and to the base on that row alone; an
adapter that does not fit is refused with one error naming the file, the key and the value."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from dgemma.model.kv_cache import RowCaches
from dgemma.weights import lora
from dgemma.weights.adapters import AdapterError, AdapterSet
from tests.helpers import random_ids, random_model, randomize_adapter_

pytest.importorskip("peft")

NAMES = ["a", None, "b", "a"]  # the rows' adapters; None: the base
TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}  # fp32 logits (|x| <= 30): W x + B (A x) against (W + B A) x


@pytest.fixture(scope="module")
def base():
    return random_model("tiny", seed=5)


def write_adapter(base, path, targets: str, rank: int, seed: int):
    """An adapter on `targets` written by `lora.save_adapter` with random A and B (B starts at zero: no delta), and
    the base with it merged in (`lora.merge` on a copy)."""
    model = copy.deepcopy(base)
    config = randomize_adapter_(model, rank, 2.0 * rank + 1, targets, seed=seed)
    lora.save_adapter(model, config, path)
    return lora.merge(model).eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Adapter "a" on attention (rank 4), "b" on attention and the routed experts (rank 2: the stack pads it)."""
    root = tmp_path_factory.mktemp("adapters")
    merged = {"a": write_adapter(base, root / "a", "attention", 4, seed=1),
              "b": write_adapter(base, root / "b", "attention+experts", 2, seed=2), None: base}
    return AdapterSet(base, {"a": root / "a", "b": root / "b"}), merged, root


def run(model, ids, canvas, impl: str, rows: bool, adapters=None) -> list[torch.Tensor]:
    """Commit `ids`, denoise `canvas`, commit it, denoise it reversed: both denoise logits. `rows`: over one-row
    caches of a pool (the engine's continuous batching) rather than one batched cache."""
    B = ids.shape[0]
    if rows:
        pool = model.new_cache(B, 48)
        cache = RowCaches([pool.rows(i, i + 1) for i in range(B)])
    else:
        cache = model.new_cache(B, 48)
    model.commit(ids, cache, adapters=adapters, impl=impl)
    first = model.denoise(canvas, cache, adapters=adapters, impl=impl)
    model.commit(canvas, cache, adapters=adapters, impl=impl)
    return [first, model.denoise(canvas.flip(1), cache, adapters=adapters, impl=impl)]


def inputs(base) -> tuple[torch.Tensor, torch.Tensor]:
    V, L = base.config.vocab_size, base.config.canvas_length
    return random_ids(V, len(NAMES), 11, seed=3), random_ids(V, len(NAMES), L, seed=4)


@pytest.mark.parametrize("rows", [False, True], ids=["batched-cache", "one-row-caches"])
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_each_row_computes_its_merged_adapter_and_base_rows_are_untouched(base, adapters, impl, rows):
    adapter_set, merged, _ = adapters
    ids, canvas = inputs(base)
    got = run(base, ids, canvas, impl, rows, adapter_set.rows(NAMES))
    plain = run(base, ids, canvas, impl, rows)
    for r, name in enumerate(NAMES):
        alone = run(merged[name], ids[r:r + 1], canvas[r:r + 1], impl, rows)
        for g, p, a in zip(got, plain, alone, strict=True):
            torch.testing.assert_close(g[r], a[0], **TOLERANCE)
            if name is None and rows:  # no zero delta added: exactly the pass without adapters, and the base alone
                assert torch.equal(g[r], p[r]) and torch.equal(g[r], a[0])
            elif name is None:  # one batched cache: the routed experts share matmuls across rows, as without adapters
                torch.testing.assert_close(g[r], p[r], **TOLERANCE)
            else:
                assert float((g[r] - p[r]).abs().max()) > 0.05  # the adapter does something


def test_no_adapter_on_any_row_is_the_base_pass(adapters):
    adapter_set, _, _ = adapters
    assert adapter_set.rows([None, None]) is None


def test_remove_and_add_between_passes(base, adapters, tmp_path):
    adapter_set, merged, root = adapters
    adapter_set = AdapterSet(base, {"a": root / "a", "b": root / "b"})
    ids, canvas = inputs(base)
    before = adapter_set.rows(["a"])
    adapter_set.remove("a")
    assert adapter_set.names == ("b",)
    with pytest.raises(AdapterError, match=r"no adapter named 'a' \(loaded: 'b'\)"):
        adapter_set.rows(["a"])
    kept = run(base, ids[:1], canvas[:1], "fast", True, before)  # rows built before keep their factors
    torch.testing.assert_close(kept[0], run(merged["a"], ids[:1], canvas[:1], "fast", True)[0], **TOLERANCE)
    adapter_set.add("a2", root / "a")
    got = run(base, ids[2:], canvas[2:], "fast", True, adapter_set.rows(["b", "a2"]))
    for r, name in enumerate(["b", "a"]):
        torch.testing.assert_close(got[0][r], run(merged[name], ids[2 + r:3 + r], canvas[2 + r:3 + r], "fast",
                                                  True)[0][0], **TOLERANCE)


def test_adapters_that_cannot_be_used_are_refused(base, adapters, tmp_path):
    adapter_set, _, root = adapters
    with pytest.raises(AdapterError, match=r"adapter name 'a' is already taken \(by .*a\)"):
        adapter_set.add("a", root / "b")
    with pytest.raises(AdapterError, match="adapter name must be 1 to 64 characters"):
        adapter_set.add("", root / "b")
    with pytest.raises(AdapterError, match=r"nowhere: not a directory"):
        adapter_set.add("c", tmp_path / "nowhere")
    assert adapter_set.names == ("a", "b")  # nothing refused was added

    other = random_model("k8-of-16")  # another geometry: the file's shapes do not fit
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: does not fit this model.*has shape"):
        AdapterSet(other, {"a": root / "a"})

    broken = tmp_path / "broken"
    write_adapter(base, broken, "attention", 4, seed=3)
    (broken / lora.WEIGHTS).unlink()
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: not a readable safetensors file"):
        AdapterSet(base, {"x": broken})

    wide = tmp_path / "wide"
    write_adapter(base, wide, "attention", 4, seed=3)
    config = json.loads((wide / lora.CONFIG).read_text())
    (wide / lora.CONFIG).write_text(json.dumps(config | {"r": 1000}))
    with pytest.raises(AdapterError, match=r"adapter_config\.json: field 'r' = 1000 is larger than"):
        AdapterSet(base, {"x": wide})

    (wide / lora.CONFIG).write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(AdapterError, match=r"field 'use_dora' = True: dgemma reads plain LoRA adapters only"):
        AdapterSet(base, {"x": wide})

    with pytest.raises(ValueError, match="adapters: 4 rows given for a batch of 2"):
        run(base, *(t[:2] for t in inputs(base)), "fast", True, adapter_set.rows(NAMES))


def test_through_the_openai_client_each_adapter_is_a_model_and_rows_batch_together(base, adapters):
    """`model` picks the adapter; requests on "a", "b" and the base run in the same batches, and each gives the
    tokens the adapter's merged checkpoint gives on an engine of its own (reference kernels, the same seed); echo
    scoring on an adapter is the merged checkpoint's bound."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    import threading

    from dgemma.data.tokenizer import build_test_tokenizer
    from dgemma.diffusion.likelihood import score_continuation
    from dgemma.sampling.generation_config import GenerationConfig
    from dgemma.serving.app import create_app
    from dgemma.serving.engine import Engine
    from tests.helpers import running_server

    adapter_set, merged, _ = adapters
    tok = build_test_tokenizer(512)
    config = GenerationConfig.for_model(base.config).replace(max_new_tokens=16, max_denoising_steps=3,
                                                             eos_token_id=())
    asks = [("a", 0), ("tiny", 1), ("b", 2), ("a", 3), ("b", 4), ("tiny", 5)]
    with Engine(base, max_batch=6, max_context=64, impl="reference", adapters=adapter_set,
                prefix_cache=128, prefix_block=16) as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=config)) as url:
        listed = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
        assert httpx.get(url + "/v1/models/b").json()["parent"] == "tiny"
        wrong = httpx.post(url + "/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 4})
        assert wrong.status_code == 404
        assert wrong.json()["error"]["message"] == "model 'c' does not exist; this server serves 'tiny', 'a', 'b'"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        out: dict[int, object] = {}

        def ask(i: int, model: str, seed: int) -> None:
            out[i] = client.completions.create(model=model, prompt="The sea and the sky", max_tokens=16, seed=seed)

        threads = [threading.Thread(target=ask, args=(i, m, s)) for i, (m, s) in enumerate(asks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = engine.stats()
        scored = client.completions.create(model="a", prompt="The sea and the sky", max_tokens=0, echo=True,
                                           logprobs=0).choices[0].logprobs.token_logprobs
        metrics = httpx.get(url + "/metrics").text
    for adapter, n in (("a", 3), ("b", 2), ("", 2)):  # two generations each, and the scoring request on "a"
        assert f'dgemma_lora_requests_total{{adapter="{adapter}",model_name="tiny"}} {n}.0' in metrics
    assert "dgemma_lora_adapters_loaded 2.0" in metrics
    assert stats.denoise_rows > stats.denoise_forwards  # rows of different adapters shared passes
    prompt = tok.encode("The sea and the sky")
    on_merged = score_continuation(merged["a"], [], prompt, num_steps=16, num_t_samples=4)
    on_base = score_continuation(base, [], prompt, num_steps=16, num_t_samples=4)
    assert scored == pytest.approx([-x for x in on_merged.tolist()], rel=1e-4, abs=1e-4)  # echo scoring: adapter "a"
    assert scored != pytest.approx([-x for x in on_base.tolist()], rel=1e-3)
    for i, (name, seed) in enumerate(asks):
        assert out[i].model == name
        with Engine(merged[None if name == "tiny" else name], max_batch=1, max_context=64,
                    impl="reference") as alone:
            tokens, _ = alone.complete(prompt, config, seed=seed)
        assert out[i].choices[0].text == tok.decode(tokens, skip_special_tokens=True), name
    texts = {out[i].choices[0].text for i in range(len(asks))}
    assert len(texts) == len(asks)  # each adapter (and the base) writes its own text


@pytest.mark.parametrize(("flags", "error"), [
    (["--lora", "a"], "argument --lora: give NAME=DIR"),
    (["--lora", "=dir"], "argument --lora: give NAME=DIR"),
    (["--lora", "tiny=DIR"], "--lora tiny=...: 'tiny' is the served model's name"),
    (["--lora", "x=A", "--lora", "x=B"], "--lora x=...: the name 'x' is given 2 times"),
    (["--lora", "x=/nowhere"], "--lora x=/nowhere: not a directory"),
    (["--lora", "x=DIR"], "--lora x=.: adapter_config.json: field 'peft_type' must be \"LORA\""),  # not an adapter
])
def test_serve_refuses_bad_lora_flags_in_one_line(flags, error, capsys, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from dgemma import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / lora.CONFIG).write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    argv = ["serve", "--preset", "tiny", "--random-init", "--model-name", "tiny",
            *[f.replace("DIR", ".") for f in flags]]
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own refusal of the flag's shape
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and error in err and "Traceback" not in err


def test_adapters_load_and_unload_while_the_server_runs(base, adapters):
    """--allow-runtime-lora: vLLM's routes load an adapter (then served, listed, and computing what its merged
    checkpoint computes) and unload it (then a 404); bad bodies and unknown names get OpenAI errors naming the field;
    without the flag the routes do not exist."""
    httpx = pytest.importorskip("httpx")
    from dgemma.data.tokenizer import build_test_tokenizer
    from dgemma.sampling.generation_config import GenerationConfig
    from dgemma.serving.app import create_app
    from dgemma.serving.engine import Engine
    from tests.helpers import running_server

    _, merged, root = adapters
    tok = build_test_tokenizer(512)
    config = GenerationConfig.for_model(base.config).replace(max_new_tokens=16, max_denoising_steps=3,
                                                             eos_token_id=())
    ask = {"prompt": "The sea", "max_tokens": 16, "seed": 4}
    with Engine(base, max_batch=2, max_context=64, impl="reference", prefix_cache=128, prefix_block=16) as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=config,
                                      allow_runtime_lora=True)) as url:
        post = lambda route, body: httpx.post(url + route, json=body, timeout=60)
        assert post("/v1/completions", {**ask, "model": "a"}).status_code == 404
        loaded = post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "a")})
        assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny", "a"]
        text = post("/v1/completions", {**ask, "model": "a"}).json()["choices"][0]["text"]
        for body, status, param in (({"lora_name": "a", "lora_path": str(root / "b")}, 400, "lora_name"),  # taken
                                    ({"lora_name": "c", "lora_path": str(root / "nowhere")}, 400, "lora_path"),
                                    ({"lora_name": "tiny", "lora_path": str(root / "a")}, 400, "lora_name"),
                                    ({"lora_name": "", "lora_path": str(root / "a")}, 400, "lora_name"),
                                    ({"lora_name": "c", "lora_path": str(root / "a"), "x": 1}, 400, "x")):
            r = post("/v1/load_lora_adapter", body)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), body
        assert post("/v1/unload_lora_adapter", {"lora_name": "a"}).json()["status"] == "unloaded"
        assert post("/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 404
        assert post("/v1/completions", {**ask, "model": "a"}).status_code == 404
    with Engine(merged["a"], max_batch=1, max_context=64, impl="reference") as alone:
        tokens, _ = alone.complete(tok.encode("The sea"), config, seed=4)
    assert text == tok.decode(tokens, skip_special_tokens=True)
    with Engine(base, max_batch=1, max_context=64) as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=config)) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")})
        assert r.status_code == 404 and "error" in r.json()


def test_an_adapter_in_use_is_not_unloaded(base, adapters):
    """Unloading waits for the requests that use the adapter: refused while one waits (the engine is not started
    here, so the request stays queued), done once it has gone; an unknown name is refused naming what is loaded."""
    from dgemma.sampling.generation_config import GenerationConfig
    from dgemma.serving.engine import Engine, EngineError

    _, _, root = adapters
    engine = Engine(base, max_batch=1, max_context=64)
    with pytest.raises(EngineError, match=r"lora_name: no adapter named 'x' \(loaded: none\)"):
        engine.unload_adapter("x")
    engine.load_adapter("a", str(root / "a"))
    config = GenerationConfig.for_model(base.config).replace(max_new_tokens=16)
    request = engine.submit([1, 2], config, on_event=lambda e: None, adapter="a")
    with pytest.raises(EngineError, match=r"adapter 'a' is in use by 1 request\(s\)"):
        engine.unload_adapter("a")
    engine.close()  # the waiting request is cancelled
    assert request.done
    engine.unload_adapter("a")
    assert engine.adapters.names == ()


# --- adapters a client or a flag may name: read by the checkpoint's rules (round-three hardening) ---------------

def hostile_adapters(base, root):
    """Adapter directories that used to load (or crash) and must be refused, with the error each must give:
    (directory, the message it must match, the field a runtime load's 400 names)."""
    from safetensors.torch import load_file, save_file

    good = root / "good"
    write_adapter(base, good, "attention", 4, seed=3)
    config = json.loads((good / lora.CONFIG).read_text())
    cases = []

    def variant(name, text=None, tensors=None):
        d = root / name
        d.mkdir()
        (d / lora.CONFIG).write_text(text if text is not None else json.dumps(config))
        if tensors is None:
            (d / lora.WEIGHTS).write_bytes((good / lora.WEIGHTS).read_bytes())
        else:
            save_file(tensors, str(d / lora.WEIGHTS))
        return d

    deep = '{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    cases.append((variant("deep", deep), r"adapter_config\.json: JSON nested too deeply"))
    cases.append((variant("alpha", json.dumps(config | {"lora_alpha": 1e300})),
                  r"adapter_config\.json: field 'lora_alpha': the scale \S+ of .* makes its LoRA update "
                  r"non-finite in float32"))
    pattern = json.dumps(config | {"alpha_pattern": {}}).replace('"alpha_pattern": {}',
                                                                 '"alpha_pattern": {"q_proj": 1e999}')
    cases.append((variant("pattern", pattern), r"field 'alpha_pattern'\['q_proj'\] must be a finite number > 0, "
                                               r"got inf"))
    cases.append((variant("rank", json.dumps(config | {"rank_pattern": {"q_proj": 0}})),
                  r"field 'rank_pattern'\['q_proj'\] must be a positive integer, got 0"))
    tensors = {k: torch.full_like(t, float("inf")) for k, t in load_file(str(good / lora.WEIGHTS)).items()}
    cases.append((variant("inf", tensors=tensors), r"adapter_model\.safetensors: tensor .* holds non-finite values"))
    fifo = variant("fifo")
    (fifo / lora.WEIGHTS).unlink()
    os.mkfifo(fifo / lora.WEIGHTS)
    cases.append((fifo, r"adapter_model\.safetensors: a FIFO \(named pipe\), not a regular file"))
    return cases


BAD_NAMES = ["\x00", "x" * 10_000, "../../etc", ".hidden", "a/b", "sp ace", "x" * 65]


def test_hostile_adapter_files_and_names_are_refused_naming_the_key(base, tmp_path):
    """A deeply nested adapter_config.json, a scale or alpha_pattern that overflows, a rank_pattern of 0, all-inf
    tensors and a FIFO for the weights are each refused with one AdapterError naming the file and the key (they used
    to raise RecursionError, load and then answer every request with non-finite logits, or block forever); names
    outside [A-Za-z0-9._-]{1,64} (or starting with '.') are refused; a good adapter still loads under a good name."""
    from dgemma.weights.adapters import AdapterNameError

    adapter_set = AdapterSet(base)
    for directory, pattern in hostile_adapters(base, tmp_path):
        with pytest.raises(AdapterError, match=pattern):
            adapter_set.add("x", directory)
    for name in BAD_NAMES:
        with pytest.raises(AdapterNameError, match=r"adapter name must be 1 to 64 characters of A-Z"):
            adapter_set.add(name, tmp_path / "good")
    adapter_set.add("Good_name-1.v2", tmp_path / "good")
    assert adapter_set.names == ("Good_name-1.v2",)


def test_runtime_loads_of_hostile_adapters_are_400s_and_the_server_goes_on(base, tmp_path):
    """Over HTTP: each hostile adapter and name is a 400 naming lora_path or lora_name, never a 500, and the
    server then serves a good adapter."""
    httpx = pytest.importorskip("httpx")
    from dgemma.data.tokenizer import build_test_tokenizer
    from dgemma.sampling.generation_config import GenerationConfig
    from dgemma.serving.app import create_app
    from dgemma.serving.engine import Engine
    from tests.helpers import running_server

    tok = build_test_tokenizer(512)
    config = GenerationConfig.for_model(base.config).replace(max_new_tokens=16, max_denoising_steps=2)
    cases = hostile_adapters(base, tmp_path)
    with Engine(base, max_batch=1, max_context=64) as engine, \
            running_server(create_app(engine, tok, "tiny", generation_config=config,
                                      allow_runtime_lora=True)) as url:
        post = lambda body: httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60)
        for directory, pattern in cases:
            r = post({"lora_name": "x", "lora_path": str(directory)})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), r.text
            assert re.search(pattern, r.json()["error"]["message"]), r.text
        for name in BAD_NAMES:
            r = post({"lora_name": name, "lora_path": str(tmp_path / "good")})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name"), r.text
        assert post({"lora_name": "good", "lora_path": str(tmp_path / "good")}).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "good", "prompt": "The sea", "max_tokens": 16},
                       timeout=60)
        assert r.status_code == 200, r.text


def test_serve_lora_with_a_deeply_nested_config_is_one_line(base, tmp_path, capsys):
    """`dgemma serve --lora NAME=DIR` with an adapter_config.json too deep for the parser, or an overflowing
    scale: one line naming the flag, the file and the key, exit 2 (it used to print a RecursionError traceback)."""
    pytest.importorskip("fastapi")
    from dgemma import cli

    cases = {d.name: (d, pattern) for d, pattern in hostile_adapters(base, tmp_path)}
    for name in ("deep", "alpha"):
        directory, pattern = cases[name]
        status = cli.main(["serve", "--preset", "tiny", "--random-init", "--lora", f"x={directory}"])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        line, = [x for x in err.splitlines() if "error" in x]
        assert line.startswith(f"dgemma serve: error: --lora x={directory}: ") and re.search(pattern, line), line


def test_a_fifo_adapter_does_not_freeze_the_server(tmp_path):
    """--allow-runtime-lora, a real `dgemma serve` process: loading an adapter whose weights file is a FIFO is a 400
    naming it, and /health and a completion are answered after it. (Reading it used to block in the safetensors
    open while holding the GIL: every thread of the server, /health included, froze until someone wrote to it.)"""
    httpx = pytest.importorskip("httpx")
    import subprocess
    import sys
    from pathlib import Path

    base = random_model("tiny", seed=0)  # the geometry `--preset tiny` serves
    directory = tmp_path / "fifo"
    write_adapter(base, directory, "attention", 4, seed=3)
    (directory / lora.WEIGHTS).unlink()
    os.mkfifo(directory / lora.WEIGHTS)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--preset", "tiny", "--random-init", "--port",
                             "0", "--max-batch", "1", "--max-context", "64", "--allow-runtime-lora"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0].rstrip("/")
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "f", "lora_path": str(directory)},
                       timeout=60)  # the old code never answered (nor did /health) until the FIFO was written to
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path"), r.text
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        done = httpx.post(url + "/v1/completions", json={"prompt": "The sea", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200, done.text
        assert "a FIFO (named pipe), not a regular file" in r.json()["error"]["message"]
    finally:
        os.close(os.open(directory / lora.WEIGHTS, os.O_RDWR))  # a reader still blocked on it (the old code) ends
        proc.kill()
        proc.wait(30)
