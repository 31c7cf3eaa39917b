"""One device's memory under expert and tensor parallelism (model/plan.py): the layout parses or is refused naming the
value; at ep=1, tp=1 every figure is model/costs.py's own; ep=K divides the experts' bytes by K exactly; tp=K divides
attention and the dense MLP, the KV cache (a KV head held whole where there are fewer than the ranks) and the scores,
and leaves the replicated parts alone; ep+tp=K is both over the same K ranks."""

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


@pytest.mark.parametrize("spec,ep,tp,devices", [("ep=8", 8, 1, 8), ("tp=2", 1, 2, 2), ("ep=4,tp=2", 4, 2, 8),
                                                ("tp=2,ep=4", 4, 2, 8), (" ep = 2 ", 2, 1, 2), ("ep=1,tp=1", 1, 1, 1),
                                                ("ep+tp=4", 4, 4, 4), ("ep + tp=2", 2, 2, 2)])
def test_parse_layout(spec, ep, tp, devices):
    layout = parse_layout(spec)
    assert (layout.ep, layout.tp, layout.devices, layout.same_ranks) == (ep, tp, devices, "+" in spec)
    assert parse_layout(str(layout)) == layout


@pytest.mark.parametrize("spec,message", [
    ("pp=2", "unknown key 'pp'"), ("ep=0", "ep must be an integer >= 1, got 0"), ("tp=-2", "tp must be .*got -2"),
    ("ep=2,ep=4", "ep given twice"), ("ep", "expected ep=K"), ("ep=x", "expected ep=K"), ("", "expected ep=K"),
    ("ep=4,", "expected ep=K"), ("ep=1.5", "expected ep=K"), ("ep=\u0664", "expected ep=K"),
    ("ep=" + "9" * 40, "expected ep=K"), ("ep=4+tp=2", "expected ep=K"), ("tp+ep=2", "unknown key 'tp\\+ep'"),
    ("ep+tp=2,ep=2", "ep\\+tp=K goes alone"), ("ep=2,ep+tp=2", "ep\\+tp=K goes alone"),
    ("ep+tp=0", "ep\\+tp must be an integer >= 1")])
def test_malformed_layouts_are_refused_naming_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_layout(spec)
    assert repr(spec) in str(e.value)


@pytest.mark.parametrize("cfg,layout,message", [
    (BIG, ParallelLayout(ep=3), "ep=3 does not divide num_experts=128"),
    (BIG, ParallelLayout(ep=256), "ep=256 does not divide num_experts=128"),
    (BIG, ParallelLayout(tp=32), "tp=32 does not divide num_attention_heads=16"),
    (BIG, ParallelLayout(tp=3), "tp=3 does not divide num_attention_heads=16"),
    (BIG, ParallelLayout(ep=256, tp=256, same_ranks=True), "ep=256 does not divide num_experts=128"),
    (TINY, ParallelLayout(tp=2, ep=3), "ep=3 does not divide num_experts=8"),
    (TINY, ParallelLayout(tp=3), "tp=3 does not divide num_attention_heads=4"),
    (dataclasses.replace(BIG, num_key_value_heads=4, num_global_key_value_heads=4, num_attention_heads=24),
     ParallelLayout(tp=6), "tp=6 neither divides num_key_value_heads=4 nor is a multiple of it"),
    (dataclasses.replace(BIG, intermediate_size=2111), ParallelLayout(tp=2), "tp=2 does not divide "
                                                                             "intermediate_size=2111"),
    (LITE, ParallelLayout(ep=2), "ep=2 needs a mixture-of-experts model")])
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


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_tp_splits_attention_the_dense_mlp_kv_cache_and_scores(tp):
    """The 26B: 8 KV heads on sliding layers, 2 on full ones; at tp=4 and up each full layer's one KV head is held
    whole by tp/2 ranks (its cache replicated), so the cache stops shrinking by tp there."""
    one, split = device_weight_bytes(BIG, ParallelLayout()), device_weight_bytes(BIG, ParallelLayout(tp=tp))
    assert split["dense_mlp"] * tp == one["dense_mlp"]
    for part in ("embedding", "experts", "self_conditioning", *REPLICATED):
        assert split.get(part) == one.get(part), part
    D = BIG.hidden_size
    q_o = sum(2 * BIG.num_attention_heads * BIG.layer_head_dim(i) * D for i in range(BIG.num_hidden_layers))
    kv = sum((1 if BIG.shares_kv(i) else 2) * plan.local_kv_heads(BIG.layer_num_kv_heads(i), tp)
             * BIG.layer_head_dim(i) * D for i in range(BIG.num_hidden_layers))
    assert split["attention"] == 2 * (q_o // tp + kv)
    m1, m = device_memory(BIG, ParallelLayout(), context=4096), device_memory(BIG, ParallelLayout(tp=tp), context=4096)
    per_token = costs.kv_cache_bytes_breakdown(BIG)
    assert m["kv_cache"] == 4096 * (per_token["sliding"] * plan.local_kv_heads(8, tp) // 8
                                    + per_token["full"] * plan.local_kv_heads(2, tp) // 2)
    assert m["activations"] * tp == m1["activations"]
    assert (m["sampler"], m["runtime"]) == (m1["sampler"], m1["runtime"])


def test_ep_and_tp_compose_on_a_mesh_and_on_the_same_ranks():
    both = device_weight_bytes(BIG, ParallelLayout(ep=4, tp=2))
    ep, tp = device_weight_bytes(BIG, ParallelLayout(ep=4)), device_weight_bytes(BIG, ParallelLayout(tp=2))
    assert both["experts"] == ep["experts"]
    assert all(both[k] == tp[k] for k in both if k not in ("experts", "total"))
    same = device_weight_bytes(BIG, ParallelLayout(ep=4, tp=4, same_ranks=True))
    assert same == device_weight_bytes(BIG, ParallelLayout(ep=4, tp=4))  # a device holds the same; fewer devices
    assert ParallelLayout(ep=4, tp=4, same_ranks=True).devices == 4


def test_tp_shards_quantized_matrices_one_by_one():
    """Quantized shards are counted as torchao stores each: int8 keeps one fp32 scale per output row, so a
    row-parallel shard (o_proj, down_proj) keeps all of its rows' scales and the halves add up to more than the
    whole; the embedding and the router stay in bf16, whole."""
    one, split = (device_weight_bytes(BIG, ParallelLayout(**kw), 2, "int8") for kw in ({}, {"tp": 2}))
    assert split["embedding"] == one["embedding"] and split["router"] == one["router"]
    assert split["dense_mlp"] * 2 > one["dense_mlp"]
    F, D = BIG.intermediate_size // 2, BIG.hidden_size  # by hand: gate/up (F, D) and down (D, F), int8 + scales
    assert split["dense_mlp"] == BIG.num_hidden_layers * (2 * (F * D + 4 * F) + D * F + 4 * D)
    assert device_weight_bytes(BIG, ParallelLayout(ep=8), 2, "int4")["experts"] * 8 == \
        costs.weight_bytes(BIG, 2, "int4")["experts"]


def test_plan_reports_both_sides_and_what_fits():
    p = plan.plan(BIG, ParallelLayout(ep=8), context=4096)
    assert p["devices"] == 8 and p["layout"] == "ep=8" and p["splits"]["experts"] == "ep: 16 of 128 experts each"
    assert p["single_device"]["total"] == sum(device_memory(BIG, ParallelLayout(), context=4096).values())
    total = p["per_device"]["total"]
    assert p["fits_gb"] == {str(gb): total <= gb * 10**9 for gb in plan.DEVICE_SIZES_GB}
    assert p["fits_gb"]["24"] and not plan.plan(BIG, ParallelLayout(tp=2))["fits_gb"]["48"]
    assert p["runs_in_dgemma"] and plan.plan(BIG, ParallelLayout(ep=4, tp=4, same_ranks=True))["runs_in_dgemma"]
    assert not plan.plan(BIG, ParallelLayout(ep=4, tp=2))["runs_in_dgemma"]  # a 2-D mesh: planning only
    assert not plan.plan(BIG, ParallelLayout(ep=8), quantize="int4")["runs_in_dgemma"]


def test_a_generate_layout_on_its_ranks():
    assert ParallelLayout.over_ranks("ep", 4) == parse_layout("ep=4")
    assert ParallelLayout.over_ranks("tp", 2) == parse_layout("tp=2")
    assert ParallelLayout.over_ranks("ep+tp", 8) == parse_layout("ep+tp=8")
    for bad in ("pp", "ep+ep", "", "ep+tp+ep"):
        with pytest.raises(ValueError, match="expected ep, tp or ep\\+tp"):
            ParallelLayout.over_ranks(bad, 2)
