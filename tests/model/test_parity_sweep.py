"""The randomized parity sweep (tests/model/sweep.py): seeded random geometries and generation settings against
transformers 5.23. A quick slice runs by default; `pytest --runslow` runs the full sweep.

Reproduce one case from the command line: `python -m tests.model.sweep 17` (or a range: `python -m tests.model.sweep
0-299`).
"""

from __future__ import annotations

import pytest

from tests.model.sweep import random_case, run_case

QUICK = range(12)
FULL = range(12, 300)


@pytest.mark.parametrize("seed", QUICK)
def test_random_geometry_matches_transformers(seed):
    run_case(random_case(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", FULL)
def test_random_geometry_matches_transformers_full_sweep(seed):
    run_case(random_case(seed))


def test_the_sweep_covers_every_knob():
    """The quick slice and the full sweep together draw every kind of case the issue names."""
    cases = [random_case(s) for s in (*QUICK, *FULL)]
    text = [c.text for c in cases]
    assert {t["num_attention_heads"] for t in text} == set(range(1, 9))
    assert {t["num_experts"] for t in text} == set(range(1, 17))
    assert any(t["top_k_experts"] == t["num_experts"] > 1 for t in text)
    assert min(t["head_dim"] for t in text) == 8 and max(t["head_dim"] for t in text) == 64
    assert any(t["sliding_window"] < c.canvas_length for t, c in zip(text, cases, strict=True))
    assert any(t["sliding_window"] > c.canvas_length + c.prompt_length for t, c in zip(text, cases, strict=True))
    assert any(t["num_global_key_value_heads"] is None for t in text)
    assert any(set(t["layer_types"]) == {"full_attention"} for t in text)
    assert {c.canvas_length for c in cases} >= {4, 64} and {c.batch for c in cases} == {1, 2, 3}
    assert min(t["vocab_size"] for t in text) == 100 and max(t["vocab_size"] for t in text) == 4096
    assert any(any(c.left_pad) for c in cases) and any(c.bf16 for c in cases)
    assert any(c.generation["pad_token_id"] is None for c in cases)
    assert {len(c.generation["eos_token_id"]) for c in cases} == {0, 1, 2, 3}
    assert {c.generation["stability_threshold"] for c in cases} == {0, 1, 2, 3}
    assert any(c.generation.get("max_length") for c in cases)
    assert any(c.generation.get("max_length") and c.generation["max_new_tokens"] == 256 for c in cases)
