"""One device's memory under expert and tensor parallelism (model/plan.py): the layout parses or is refused naming the
value; at ep=1, tp=1 every figure is model/costs.py's own; ep=K divides the experts' bytes by K exactly; tp=K divides
the attention, MLP and embedding matrices, the KV cache and the scores, and leaves the replicated parts alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dgemma
from dgemma.model import costs, plan
from dgemma.model.plan import ParallelLayout, check_layout, device_memory, device_weight_bytes, parse_layout

BIG = dgemma.preset("diffusiongemma-26b-a4b")  # 128 experts, 16 heads, KV heads 8 sliding / 2 full, width 2112
TINY = dgemma.preset("tiny")  # 8 experts, 4 heads, KV heads 2 / 1
LITE = dgemma.preset("lite-tiny")  # dense, linear self-conditioning
REPLICATED = ("router", "norms", "time_embedding")


@pytest.mark.parametrize("spec,ep,tp", [("ep=8", 8, 1), ("tp=2", 1, 2), ("ep=4,tp=2", 4, 2), ("tp=2+ep=4", 4, 2),
                                        (" ep = 2 ", 2, 1), ("ep=1,tp=1", 1, 1)])
def test_parse_layout(spec, ep, tp):
    layout = parse_layout(spec)
    assert (layout.ep, layout.tp, layout.devices) == (ep, tp, ep * tp)
    assert parse_layout(str(layout)) == layout


@pytest.mark.parametrize("spec,message", [
    ("pp=2", "unknown key 'pp'"), ("ep=0", "ep must be an integer >= 1, got 0"), ("tp=-2", "tp must be .*got -2"),
    ("ep=2,ep=4", "ep given twice"), ("ep", "expected ep=K"), ("ep=x", "expected ep=K"), ("", "expected ep=K"),
    ("ep=4,", "expected ep=K"), ("ep=1.5", "expected ep=K"), ("ep=\u0664", "expected ep=K"),
    ("ep=" + "9" * 40, "expected ep=K")])
def test_malformed_layouts_are_refused_naming_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_layout(spec)
    assert repr(spec) in str(e.value)


@pytest.mark.parametrize("cfg,layout,message", [
    (BIG, ParallelLayout(ep=3), "ep=3 does not divide num_experts=128"),
    (BIG, ParallelLayout(ep=256), "ep=256 does not divide num_experts=128"),
    (BIG, ParallelLayout(tp=4), "tp=4 does not divide num_global_key_value_heads=2"),
    (BIG, ParallelLayout(tp=3), "tp=3 does not divide num_attention_heads=16"),
    (TINY, ParallelLayout(tp=2, ep=3), "ep=3 does not divide num_experts=8"),
    (TINY, ParallelLayout(tp=2), "tp=2 does not divide num_global_key_value_heads=1"),
    (LITE, ParallelLayout(ep=2), "ep=2 needs a mixture-of-experts model"),
    (LITE, ParallelLayout(tp=4), "tp=4 does not divide num_key_value_heads=2")])
def test_layouts_that_do_not_divide_are_refused_naming_the_value(cfg, layout, message):
    with pytest.raises(ValueError, match=message):
        check_layout(cfg, layout)
    with pytest.raises(ValueError, match=message):
        device_memory(cfg, layout)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("cfg", [BIG, TINY, LITE], ids=["26b", "tiny", "lite-tiny"])
def test_one_device_is_the_unsplit_accounting(cfg, quantize):
    one = ParallelLayout()
    assert device_weight_bytes(cfg, one, 2, quantize) == costs.weight_bytes(cfg, 2, quantize)
    memory = device_memory(cfg, one, batch=3, context=1000, quantize=quantize)
    needed = costs.memory_needed(cfg, torch.bfloat16, weights=True, batch_size=3, cache_length=1000,
                                 quantize=quantize)
    assert {k: v for k, v in memory.items() if k != "activations"} == needed
    assert memory["activations"] == costs.attention_scores_bytes(cfg, 3, cfg.canvas_length, 1000 + cfg.canvas_length)


@pytest.mark.parametrize("ep", [2, 4, 8, 16, 128])
def test_ep_divides_the_experts_exactly_and_nothing_else(ep):
    one, split = device_weight_bytes(BIG, ParallelLayout()), device_weight_bytes(BIG, ParallelLayout(ep=ep))
    assert split["experts"] * ep == one["experts"]
    assert {k: v for k, v in split.items() if k not in ("experts", "total")} == \
        {k: v for k, v in one.items() if k not in ("experts", "total")}
    assert split["total"] == one["total"] - one["experts"] + one["experts"] // ep
    m1, m = device_memory(BIG, ParallelLayout()), device_memory(BIG, ParallelLayout(ep=ep))
    assert {k: v for k, v in m.items() if k != "weights"} == {k: v for k, v in m1.items() if k != "weights"}


def test_tp_splits_the_column_and_row_parallel_parts():
    one, split = device_weight_bytes(BIG, ParallelLayout()), device_weight_bytes(BIG, ParallelLayout(tp=2))
    counts = costs.parameter_counts(BIG)["breakdown"]
    for part in ("embedding", "attention", "dense_mlp"):  # all matrices: exactly half
        assert split[part] * 2 == one[part], part
    sc_norm = BIG.hidden_size * 2  # self-conditioning's pre_norm stays whole
    assert split["self_conditioning"] - sc_norm == (one["self_conditioning"] - sc_norm) // 2
    for part in ("experts", *REPLICATED):
        assert split.get(part) == one.get(part), part
    assert counts["experts"] * 2 == one["experts"]
    m1, m = device_memory(BIG, ParallelLayout(), context=4096), device_memory(BIG, ParallelLayout(tp=2), context=4096)
    assert m["kv_cache"] * 2 == m1["kv_cache"] and m["activations"] * 2 == m1["activations"]
    assert (m["sampler"], m["runtime"]) == (m1["sampler"], m1["runtime"])


def test_ep_and_tp_compose():
    both = device_weight_bytes(BIG, ParallelLayout(ep=4, tp=2))
    ep, tp = device_weight_bytes(BIG, ParallelLayout(ep=4)), device_weight_bytes(BIG, ParallelLayout(tp=2))
    assert both["experts"] == ep["experts"]
    assert all(both[k] == tp[k] for k in both if k not in ("experts", "total"))


def test_tp_shards_quantized_matrices_one_by_one():
    """int4 pads each shard's input width to 1024: a row-parallel shard of o_proj (4096 -> 2048 inputs) still holds
    exactly half; the embedding and the router stay in bf16."""
    one, split = (device_weight_bytes(BIG, ParallelLayout(**kw), 2, "int4") for kw in ({}, {"tp": 2}))
    assert split["embedding"] * 2 == one["embedding"]
    assert split["attention"] < one["attention"] and split["router"] == one["router"]
    # int8 keeps one fp32 scale per output row: a row-parallel shard keeps all of its rows' scales
    int8 = device_weight_bytes(BIG, ParallelLayout(tp=2), 2, "int8")
    assert int8["attention"] * 2 > costs.weight_bytes(BIG, 2, "int8")["attention"]


def test_the_vocabulary_split_pads_the_last_shard():
    cfg = dataclasses.replace(LITE, vocab_size=513)
    assert device_weight_bytes(cfg, ParallelLayout(tp=2))["embedding"] == 257 * cfg.hidden_size * 2


def test_plan_reports_both_sides_and_what_fits():
    p = plan.plan(BIG, ParallelLayout(ep=8), context=4096)
    assert p["devices"] == 8 and p["layout"] == "ep=8" and p["splits"]["experts"] == "ep: 16 of 128 experts each"
    assert p["single_device"]["total"] == sum(device_memory(BIG, ParallelLayout(), context=4096).values())
    total = p["per_device"]["total"]
    assert p["fits_gb"] == {str(gb): total <= gb * 10**9 for gb in plan.DEVICE_SIZES_GB}
    assert p["fits_gb"]["24"] and not plan.plan(BIG, ParallelLayout(tp=2))["fits_gb"]["48"]
