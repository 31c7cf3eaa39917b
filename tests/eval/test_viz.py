"""dgemma viz: pictures of a trace the test makes (tiny random model), the HTML player (parsed, its script checked
by node, and run in headless Chromium when installed), and bad traces."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import dgemma
from dgemma.cli import main
from dgemma.data.tokenizer import build_test_tokenizer
from dgemma.sampling.trace import TRACE_FORMAT

pytest.importorskip("matplotlib", reason="dgemma[viz] not installed")
from PIL import Image

from dgemma.eval import viz
from dgemma.sampling.trace import load_trace

STEPS = 4


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    """A traced generation: 2 rows, 2 canvases of 16, 4 steps, entropy-bound sampler with a stop rule that lets row
    stops happen; saved as the generate CLI does."""
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=1).eval()
    prompt = torch.randint(5, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    result = dgemma.generate(model, prompt, seed=0, max_new_tokens=32, max_denoising_steps=STEPS, trace=True,
                             entropy_bound=2.0)
    d = tmp_path_factory.mktemp("trace")
    result.trace.save(d / "run")
    build_test_tokenizer(512, d / "tokenizer.json")
    return d / "run"


@pytest.fixture(scope="module")
def rendered(trace_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("viz")
    rc = main(["viz", str(trace_path), "--out", str(out), "--tokenizer", str(trace_path.parent / "tokenizer.json"),
               "--canvas", "1"])
    assert rc == 0
    return out


def test_viz_writes_pngs_of_the_expected_size_for_the_canvas_asked_for(rendered):
    expected = (int(viz.FIGURE_INCHES[0] * viz.DPI), int(viz.FIGURE_INCHES[1] * viz.DPI))
    assert not (rendered / "canvas_00_entropy.png").exists()
    for c in (1,):
        for name in ("entropy", "finalized", "acceptance_transitions", "order"):
            path = rendered / f"canvas_{c:02d}_{name}.png"
            with Image.open(path) as im:
                assert im.size == expected, path
                colours = len(np.unique(np.asarray(im.convert("RGB")).reshape(-1, 3), axis=0))
            assert colours > 20, f"{path} looks empty ({colours} colours)"


def test_viz_gif_has_one_frame_per_step(rendered, trace_path):
    arrays = load_trace(trace_path).arrays
    steps = int(((arrays["canvas"] == 1) & arrays["active"][:, 0]).sum())
    with Image.open(rendered / "canvas_01.gif") as im:
        assert im.n_frames == steps >= 2
        assert im.size == (int(viz.GIF_INCHES[0] * viz.GIF_DPI), int(viz.GIF_INCHES[1] * viz.GIF_DPI))


class _Scripts(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts, self.external, self._in = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("src") or (tag == "link" and attrs.get("href")):
            self.external.append((tag, attrs))
        if tag == "script":
            self._in = [attrs.get("type"), attrs.get("id"), ""]

    def handle_data(self, data):
        if self._in is not None:
            self._in[2] += data

    def handle_endtag(self, tag):
        if tag == "script" and self._in is not None:
            self.scripts.append(tuple(self._in))
            self._in = None


def test_player_is_one_self_contained_file_with_the_trace_and_token_text(rendered, trace_path, tmp_path):
    page = (rendered / "player.html").read_text(encoding="utf-8")
    parser = _Scripts()
    parser.feed(page)
    assert parser.external == []  # nothing fetched: inline CSS and JS only
    (kind, ident, data), (_, _, code) = parser.scripts
    assert kind == "application/json" and ident == "trace-data"
    payload = json.loads(data)
    trace = load_trace(trace_path)
    assert payload["format"] == TRACE_FORMAT and payload["canvas_length"] == 16 and payload["batch_size"] == 2
    assert len(payload["steps"]) == len(trace.arrays["canvas"])
    assert payload["steps"][0]["argmax"] == trace.arrays["argmax"][0].tolist()
    tok = build_test_tokenizer(512)
    some_id = payload["steps"][-1]["argmax"][0][0]
    assert payload["vocab"][str(some_id)] == viz.token_texts(np.array([some_id]), tok)[some_id]
    assert "dgemma viz" in page  # the command that produced it
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the script's syntax is not checked")
    script = tmp_path / "player.js"
    script.write_text(code)
    check = subprocess.run([node, "--check", str(script)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_each_step_marks_what_it_accepted_renoised_or_changed():
    """Two rows, one canvas of 3 positions over 4 steps (row 1 stops after step 1), then a second canvas."""
    acc = np.array([[[0, 0, 0], [1, 0, 0]],
                    [[1, 1, 0], [1, 1, 0]],
                    [[1, 0, 1], [0, 0, 0]],
                    [[1, 0, 1], [0, 0, 0]],
                    [[1, 1, 1], [0, 0, 0]]], dtype=bool)
    x = np.array([[[9, 9, 9], [9, 9, 9]],
                  [[5, 9, 9], [5, 9, 9]],
                  [[5, 6, 9], [5, 6, 9]],
                  [[5, 9, 7], [0, 0, 0]],
                  [[4, 4, 4], [0, 0, 0]]])  # step 3's output is not in the trace: its canvas ends there
    arrays = {"canvas": np.array([0, 0, 0, 0, 1]), "accepted": acc, "input_canvas": x,
              "active": np.array([[1, 1], [1, 1], [1, 0], [1, 0], [1, 0]], dtype=bool)}
    changes = viz.step_changes(arrays)
    assert changes[0].tolist() == [[0, 0, 0], [0, 0, 0]]  # a canvas's first step has nothing to compare with
    assert changes[1].tolist() == [[1, 1, 0], [0, 1, 0]]
    assert changes[2, 0].tolist() == [0, 2, 1] and changes[2, 1].tolist() == [0, 0, 0]  # row 1 is done
    # position 0 stays accepted and keeps 5 (input of step 3); position 2 stays accepted: no later step to show it
    assert changes[3, 0].tolist() == [0, 0, 0] and changes[4].tolist() == [[0, 0, 0], [0, 0, 0]]
    x[3, 0, 0] = 8  # step 2 left another token at an accepted position: an edit
    assert viz.step_changes(arrays)[2, 0].tolist() == [3, 2, 1]
    assert viz.CHANGES[3] == "changed while accepted"


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.integration
@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_player_loads_steps_and_plays_in_headless_chromium(rendered):
    url = (rendered / "player.html").as_uri()

    def dom(fragment: str) -> str:
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
               "--dump-dom", url + fragment]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout

    opened = dom("")
    assert 'data-ready="1"' in opened and "data-error" not in opened
    assert len(re.findall(r'class="cell( accepted)?( c[123])?"', opened)) == 16
    assert 'data-step="1"' in opened
    assert 'data-step="3"' in dom("#step=2")  # the slider position K shows step K + 1
    played = dom("#play")  # virtual time runs the timer to the end of canvas 0
    assert f'data-step="{STEPS}"' in played and "data-error" not in played


@pytest.fixture(scope="module")
def constrained_player(tmp_path_factory):
    """The player of a generation under a JSON grammar with a budget the random model cannot meet by itself (it
    never closes a free string)."""
    pytest.importorskip("llguidance")
    from dgemma.data.tokenizer import load_tokenizer
    from dgemma.sampling.constraint import Constraint

    d = tmp_path_factory.mktemp("constrained")
    build_test_tokenizer(512, d / "tokenizer.json")
    model = dgemma.init_weights(dgemma.DiffusionGemma(dgemma.preset("tiny")), seed=1).eval()
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
              "additionalProperties": False}
    c = Constraint.json_schema(schema, load_tokenizer(d / "tokenizer.json"), eos_token_id=1)
    prompt = torch.randint(5, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    result = dgemma.generate(model, prompt, seed=0, max_new_tokens=32, max_denoising_steps=STEPS, trace=True,
                             constraint=c, eos_token_id=1)
    result.trace.save(d / "run")
    assert main(["viz", str(d / "run"), "--out", str(d / "viz"), "--tokenizer", str(d / "tokenizer.json"),
                 "--canvas", "1"]) == 0
    return d, result


def test_a_constrained_trace_carries_what_the_grammar_did_into_the_player(constrained_player):
    d, result = constrained_player
    data = viz.player_data(load_trace(d / "run"))
    marks = [m for s in data["steps"] for m in s["grammar"][0]]
    assert set(marks) <= {0, 1, 2} and 2 in marks and 1 in marks  # the closer ended the object within 32 tokens
    assert result.constraint_complete == [True] and result.constraint_closed >= 1
    assert marks.count(2) == int((result.trace.arrays()["grammar"] == 2).sum())
    page = (d / "viz" / "player.html").read_text(encoding="utf-8")
    assert "grammar: pinned " in page and "closed (the budget" in page


@pytest.mark.integration
@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_the_player_shows_the_grammar_marks_in_headless_chromium(constrained_player):
    d, _ = constrained_player
    url = (d / "viz" / "player.html").as_uri()
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--dump-dom",
           url]
    opened = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-ready="1"' in opened and "data-error" not in opened
    assert re.search(r"grammar: pinned \d+, closed \d+", opened)


def test_helpers_lay_out_reading_order_and_find_finalization_steps():
    assert viz.grid_width(256) == 16 and viz.grid_width(16) == 4 and viz.grid_width(32) == 8
    grid = viz.reading_order(np.arange(10.0), 4)
    assert grid.shape == (3, 4) and grid[1, 0] == 4 and np.isnan(grid[2, 3])
    argmax = np.array([[1, 2, 3], [1, 5, 3], [1, 5, 4], [1, 5, 3]])
    assert viz.finalized_step(argmax).tolist() == [0, 1, 3]


# --- bad traces -----------------------------------------------------------------------------------------------------

def _copy(trace_path, tmp_path):
    for suffix in (".json", ".npz"):
        shutil.copy(trace_path.with_suffix(suffix), tmp_path / f"t{suffix}")
    return tmp_path / "t"


def test_a_trace_from_another_version_or_not_a_trace_is_a_clear_error(trace_path, tmp_path, capsys):
    path = _copy(trace_path, tmp_path)
    summary = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps(summary | {"format": "dgemma-trace-0"}))
    assert main(["viz", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "another version of dgemma" in capsys.readouterr().err
    del summary["format"]
    path.with_suffix(".json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"not a dgemma trace \(missing format field\)"):
        load_trace(path)
    path.with_suffix(".json").write_text("{oops")
    with pytest.raises(ValueError, match="not a dgemma trace"):
        load_trace(path)
    path.with_suffix(".npz").unlink()
    assert main(["viz", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "t.npz: missing" in capsys.readouterr().err


def test_inconsistent_arrays_and_bad_selections_are_errors(trace_path, tmp_path):
    path = _copy(trace_path, tmp_path)
    with np.load(path.with_suffix(".npz")) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(path.with_suffix(".npz"), **(arrays | {"entropy": arrays["entropy"][:, :, :3]}))
    with pytest.raises(ValueError, match="'entropy' has shape"):
        load_trace(path)
    trace = load_trace(trace_path)
    with pytest.raises(ValueError, match="--row 5"):
        viz.render_trace(trace, tmp_path / "o", command="x", row=5)
    with pytest.raises(ValueError, match="--canvas"):
        viz.render_trace(trace, tmp_path / "o", command="x", canvases=[7])


def test_missing_matplotlib_says_what_to_install(monkeypatch, trace_path, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert main(["viz", str(trace_path), "--out", str(tmp_path)]) == 2
    assert "pip install 'dgemma[viz]'" in capsys.readouterr().err
