"""Parallel generation on a gloo process group of 2 CPU processes (torch.multiprocessing), the tiny MoE in fp32:
expert parallelism gives the logits and tokens of one process bit for bit; tensor parallelism (and ep+tp) logits
within fp32 rounding and the same tokens on the tested seeds; every rank holds the same bits; shapes that do not
divide are refused in one line naming the value. The real `torchrun ... dgemma generate --parallel` runs in
test_parallel_cli.py (integration tier)."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dgemma.model import kernels
from dgemma.model.config import preset
from dgemma.parallel import ParallelError, check_layout
from tests.parallel.workers import rank_main, single, tiny_config

# (layout, kernels, kv heads: 2 on every layer, split one a rank; None: the tiny preset's 1 on full layers, which
# both ranks hold; dtype)
JOBS = [("ep", "fast", None, "float32"), ("ep", "reference", None, "float32"), ("ep", "fast", None, "bfloat16"),
        ("tp", "fast", 2, "float32"), ("tp", "reference", 2, "float32"), ("ep+tp", "fast", None, "float32")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Each job's result on rank 0 of a world of 2, and one process's result for each kernel choice."""
    out = tmp_path_factory.mktemp("parallel") / "results.pt"
    mp.spawn(rank_main, args=(2, free_port(), JOBS, str(out)), nprocs=2)
    return torch.load(out), {job[1:]: single(tiny_config(job[2]), job[1], job[3]) for job in JOBS}


@pytest.mark.parametrize("impl, dtype", [job[1::2] for job in JOBS if job[0] == "ep"])
def test_expert_parallel_is_bit_identical_to_one_process(world2, impl, dtype):
    got, one = world2
    result, alone = got[("ep", impl, None, dtype)], one[(impl, None, dtype)]
    assert torch.equal(result["logits"], alone["logits"])
    assert torch.equal(result["row_logits"], alone["row_logits"])  # one-row caches batched (per_row)
    assert result["tokens"] == alone["tokens"]
    assert result["same_on_every_rank"]


@pytest.mark.parametrize("layout, impl, heads", [job[:3] for job in JOBS if "tp" in job[0]])
def test_tensor_parallel_is_within_fp32_rounding_and_draws_the_same_tokens(world2, layout, impl, heads):
    """Split kv heads (2 on 2 ranks) and replicated ones (ep+tp on the tiny preset: 1 on full layers); both kernels."""
    got, one = world2
    result, alone = got[(layout, impl, heads, "float32")], one[(impl, heads, "float32")]
    torch.testing.assert_close(result["logits"], alone["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result["row_logits"], alone["row_logits"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(result["logits"], alone["logits"])  # a rank-order sum: rounding differs, as documented
    assert result["tokens"] == alone["tokens"]
    assert result["same_on_every_rank"]  # the rank-order sum: every rank's sampler sees the same bits


def test_the_split_kernel_is_the_single_process_kernel():
    """moe_experts = sort_slots, expert_rows, combine_slots; expert_rows on a run of experts is bit for bit the
    rows of those experts in the whole call (what each expert-parallel rank relies on), for every backend."""
    g = torch.Generator().manual_seed(0)
    E, D, Ie, N, k = 8, 64, 32, 40, 2
    gate_up, down = torch.randn(E, 2 * Ie, D, generator=g), torch.randn(E, D, Ie, generator=g)
    x, experts = torch.randn(N, D, generator=g), torch.randint(0, E, (N, k), generator=g)
    order, counts = kernels.sort_slots(experts, E)
    xs = x.index_select(0, order // k)
    for backend in ("loop", "grouped", "padded", "auto"):
        whole = kernels.expert_rows(xs, counts, gate_up, down, backend=backend)
        lo = int(counts[:4].sum())
        halves = [kernels.expert_rows(xs[:lo], counts[:4], gate_up[:4].clone(), down[:4].clone(), backend=backend),
                  kernels.expert_rows(xs[lo:], counts[4:], gate_up[4:].clone(), down[4:].clone(), backend=backend)]
        assert torch.equal(torch.cat(halves), whole), backend
        weights = torch.rand(N, k, generator=g)
        assert torch.equal(kernels.combine_slots(whole, order, weights, x.dtype),
                           kernels.moe_experts(x, weights, experts, gate_up, down, backend=backend))


@pytest.mark.parametrize("layout, world, changes, message", [
    ("ep", 3, {}, "ep=3 does not divide num_experts=8"),
    ("tp", 8, {}, "tp=8 does not divide num_attention_heads=4"),
    ("ep+tp", 3, {"num_experts": 6}, "tp=3 does not divide num_attention_heads=4"),
    ("tp", 4, {"intermediate_size": 90}, "tp=4 does not divide intermediate_size=90"),
    ("tp", 4, {"num_attention_heads": 12, "num_key_value_heads": 6},
     "tp=4 neither divides num_key_value_heads=6 nor is a multiple of it"),
])
def test_shapes_that_do_not_divide_are_refused_naming_the_value(layout, world, changes, message):
    with pytest.raises(ParallelError) as e:
        check_layout(dataclasses.replace(preset("tiny"), **changes), layout, world)
    assert str(e.value) == f"--parallel {layout}: {message}"


def test_the_tiny_preset_splits_at_2_and_4_and_an_unknown_layout_is_refused():
    for layout in ("ep", "tp", "ep+tp"):
        for world in (1, 2, 4):
            check_layout(preset("tiny"), layout, world)  # kv heads fewer than the ranks are replicated
    with pytest.raises(ParallelError, match="--parallel must be one of ep, tp, ep\\+tp, got 'pp'"):
        check_layout(preset("tiny"), "pp", 2)


def test_a_dense_model_has_no_experts_to_split():
    dense = dataclasses.replace(preset("lite-tiny"))
    with pytest.raises(ParallelError, match="num_experts=0"):
        check_layout(dense, "ep", 2)
    check_layout(dense, "tp", 2)
