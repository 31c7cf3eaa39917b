"""Weight-only quantization (dgemma/weights/quantize.py) and expert offload (dgemma/weights/offload.py), pinned to the
readable path.

Quantized: the quantized model computes what the float model computes with the dequantized weights (the readable
path on those weights), to fp32 rounding, on the reference and the fast kernels, in batches and over one-row caches
(the serving engine's pass); the quantized weights are within half a step of the originals; the bytes built are the
bytes `costs.weight_bytes` (the pre-flight, `dgemma inspect --quantize`) counts; loading quantizes exactly as
`quantize_model` does. Offloaded: bit-identical to the in-memory model. The quality numbers (logit error against
fp32, held-out NELBO, generation agreement) are measured by runs/quant_quality.py, not asserted here.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import dgemma
from dgemma.model import costs
from dgemma.model.costs import check_memory
from dgemma.model.kv_cache import RowCaches
from dgemma.weights import offload, quantize
from tests.helpers import random_ids, random_model

pytest.importorskip("torchao")  # dgemma.weights.quantize imports without it, but quantizes nothing

# Tolerance of "the same computation up to fp32 rounding": torchao multiplies by the int8 values and scales the output
# rows afterwards ((x @ q^T) * s), the float twin multiplies by the dequantized weights (x @ (q * s)^T); each output is
# a sum of D <= 1024 products of magnitude <= 10 here, so the two roundings differ by well under 1e-4.
ATOL = 1e-4


def dequantized(model: nn.Module) -> nn.Module:
    """A float copy of a quantized model: every quantized tensor replaced by its dequantized value."""
    out = copy.deepcopy(model)
    for name in list(quantize.quantized_names(out)):
        owner, _, attr = name.rpartition(".")
        module = out.get_submodule(owner)
        w = getattr(module, attr)
        value = torch.stack([w[e].dequantize() for e in range(len(w))]) if isinstance(w, quantize.ExpertMatrices) \
            else w.dequantize()
        module._parameters.pop(attr, None)
        module._modules.pop(attr, None)
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    assert quantize.quantization_of(out) is None
    return out


@pytest.fixture(scope="module")
def models():
    model = random_model("tiny")
    return model, quantize.quantize_model(copy.deepcopy(model), "int8")


def test_int8_weights_are_within_half_a_step_of_the_originals(models):
    model, q = models
    state = dict(model.named_parameters())
    names = list(quantize.quantized_names(model))
    assert any("experts" in n for n in names) and "layers.0.router.proj.weight" not in names
    assert "embed_tokens.weight" not in names  # the tied head stays in the model dtype (module docstring)
    for name in names:
        w = q.get_parameter(name)
        step = w.scale  # per output row (and expert): max|w| / 127.5, the codes -128..127
        err = (w.dequantize() - state[name]).abs()
        # half a step, up to the fp32 rounding of the scale itself (relative 2^-24, times codes up to 128)
        assert bool((err <= step / 2 * (1 + 1e-4)).all()), name


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_int8_model_computes_what_the_float_model_does_with_the_dequantized_weights(models, impl):
    _, q = models
    twin = dequantized(q)
    prompt, canvas = random_ids(512, 2, 12, seed=1), random_ids(512, 2, 16, seed=2)
    torch.testing.assert_close(q(prompt, canvas, impl=impl), twin(prompt, canvas, impl="reference"), rtol=0,
                               atol=ATOL)


def test_int8_one_row_caches_are_batch_invariant(models):
    """The serving engine's pass (denoise over one-row caches, experts in whole blocks of rows) on the quantized
    weights: each row gets exactly what it gets alone."""
    _, q = models
    pool = q.new_cache(3, 32)
    lengths = [3, 20, 11]
    for r, n in enumerate(lengths):
        q.commit(random_ids(512, 1, n, seed=r), pool.rows(r, r + 1, length=0))
    rows = [pool.rows(r, r + 1, length=n) for r, n in enumerate(lengths)]
    canvas = random_ids(512, 3, 16, seed=9)
    for impl in ("reference", "fast"):
        batched = q.denoise(canvas, RowCaches(rows), impl=impl)
        for r in range(3):
            alone = q.denoise(canvas[r:r + 1], rows[r] if impl == "reference" else RowCaches([rows[r]]), impl=impl)
            assert torch.equal(batched[r:r + 1], alone), (impl, r)


def test_per_expert_matrices_compute_what_the_3d_tensor_does(models):
    """`ExpertMatrices` (how int4 holds its experts: torchao's int4 tensors are 2-D) against the 3-D int8 tensor:
    the same quantization per (expert, row), so the same logits bit for bit, on both expert loops."""
    model, q = models
    per_expert = copy.deepcopy(model)
    tq = quantize._torchao()
    for name in list(quantize.quantized_names(per_expert)):
        w = per_expert.get_parameter(name).detach()
        value = quantize.ExpertMatrices([tq.Int8Tensor.from_hp(w[e], granularity=tq.PerRow()) for e in range(len(w))],
                                        tuple(w.shape)) if w.ndim == 3 else quantize.quantize_weight(w, "int8")
        quantize._set(per_expert, name, value)
    prompt, canvas = random_ids(512, 1, 12, seed=3), random_ids(512, 1, 16, seed=4)
    for impl in ("reference", "fast"):
        assert torch.equal(per_expert(prompt, canvas, impl=impl), q(prompt, canvas, impl=impl)), impl


@pytest.mark.parametrize("name", ["tiny", "lite-tiny"])
def test_the_bytes_built_are_the_bytes_costs_counts(name):
    cfg = dgemma.preset(name)
    q = quantize.quantize_model(dgemma.init_weights(dgemma.DiffusionGemma(cfg)), "int8")
    scalars = 2 * cfg.num_hidden_layers * 4  # the layer_scalar buffers, which costs does not count
    assert quantize.storage_bytes(q) == costs.weight_bytes(cfg, 4, "int8")["total"] + scalars
    parts = check_memory(dgemma.preset("diffusiongemma-26b-a4b"), torch.bfloat16, weights=True, force=True,
                         quantize="int8")
    assert parts["weights"] == costs.weight_bytes(dgemma.preset("diffusiongemma-26b-a4b"), 2, "int8")["total"]
    offloaded = check_memory(dgemma.preset("diffusiongemma-26b-a4b"), torch.bfloat16, weights=True, force=True,
                             offload_experts=True)
    w = costs.weight_bytes(dgemma.preset("diffusiongemma-26b-a4b"), 2)
    assert offloaded["weights"] == w["total"] - w["experts"]


def test_int4_accounting_follows_torchaos_padded_layout():
    # tinygemm pads the input width to 1024 and outputs to 8; a scale and a zero (bf16) per 128 inputs
    assert costs.quantized_matrix_bytes(2816, 704, "int4") == 2816 * 1024 // 2 + 2816 * 8 * 4
    assert costs.quantized_matrix_bytes(2816, 704, "int8") == 2816 * 704 + 2816 * 4


def test_loading_quantizes_each_tensor_as_quantize_model_does(tmp_path, models):
    model, q = models
    dgemma.save_pretrained(model, tmp_path)
    loaded = dgemma.load_model(tmp_path, quantize="int8")
    assert quantize.quantization_of(loaded) == quantize.quantization_of(q) == "int8"
    prompt, canvas = random_ids(512, 1, 12, seed=5), random_ids(512, 1, 16, seed=6)
    assert torch.equal(loaded(prompt, canvas), q(prompt, canvas))
    with pytest.raises(ValueError, match="quantized to int8 cannot be saved"):
        dgemma.save_pretrained(loaded, tmp_path / "again")


def test_bad_modes_and_devices_are_refused_clearly(tmp_path, models):
    model, _ = models
    dgemma.save_pretrained(model, tmp_path)
    with pytest.raises(quantize.QuantizationError, match="must be one of int8, int4, got 'int3'"):
        dgemma.load_model(tmp_path, quantize="int3")
    if not torch.cuda.is_available():
        with pytest.raises(quantize.QuantizationError, match="no int4 weight-only kernel for cpu"):
            dgemma.load_model(tmp_path, quantize="int4")
    with pytest.raises(ValueError, match="do not combine"):
        dgemma.load_model(tmp_path, quantize="int8", offload_experts=True)


def test_cli_int4_on_cpu_is_one_line_and_exit_2():
    if torch.cuda.is_available():
        pytest.skip("int4 runs on this machine's GPU")
    done = subprocess.run([sys.executable, "-m", "dgemma", "generate", "--preset", "tiny", "--random-init",
                           "--prompt-ids", "2,3", "--quantize", "int4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dgemma generate: error: --quantize int4: torchao " + quantize.torchao_version() + " has no int4 weight-only "
        "kernel for cpu (its int4 layout, tinygemm, runs on CUDA GPUs of compute capability 8.0 or newer); use "
        "--quantize int8 here"]


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_offloaded_experts_are_bit_identical(tmp_path, models, impl):
    model, _ = models
    dgemma.save_pretrained(model, tmp_path / "ckpt")
    prompt, canvas = random_ids(512, 2, 12, seed=7), random_ids(512, 2, 16, seed=8)
    want = model(prompt, canvas, impl=impl)
    mapped = offload.offload_experts(copy.deepcopy(model), tmp_path / "experts.safetensors")
    loaded = dgemma.load_model(tmp_path / "ckpt", offload_experts=True)  # mapped from the checkpoint itself
    assert offload.offloaded_to(loaded) == str(tmp_path / "ckpt" / "model.safetensors")
    assert offload.offloaded_to(mapped) == str(tmp_path / "experts.safetensors") and offload.offloaded_to(model) is None
    for m in (mapped, loaded):
        assert not any(p.ndim == 3 for p in m.parameters())  # no expert tensor left in memory
        assert torch.equal(m(prompt, canvas, impl=impl), want)
        offload.evict(m)  # a cold read from the file computes the same
        assert torch.equal(m(prompt, canvas, impl=impl), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int4_and_offload():
    """int4 (tinygemm) against its dequantized float twin, and offloaded experts fetched on a side stream against the
    in-GPU model (bit-identical: the same tensors, copied)."""
    model = random_model("tiny").to("cuda", torch.bfloat16)
    prompt, canvas = random_ids(512, 2, 12, seed=1).cuda(), random_ids(512, 2, 16, seed=2).cuda()
    q = quantize.quantize_model(copy.deepcopy(model), "int4")
    assert isinstance(q.layers[0].experts.gate_up_proj, quantize.ExpertMatrices)
    assert quantize.quantization_of(q) == "int4"
    twin = dequantized(q)
    for impl in ("reference", "fast"):
        torch.testing.assert_close(q(prompt, canvas, impl=impl), twin(prompt, canvas, impl=impl), rtol=0.02, atol=0.5)
    off = offload.offload_experts(copy.deepcopy(model), "unused")
    assert offload.offloaded_to(off) == "pinned host memory"
    for impl in ("reference", "fast"):
        assert torch.equal(off(prompt, canvas, impl=impl), model(prompt, canvas, impl=impl)), impl
