"""LoRA adapters (dgemma/weights/lora.py): saved in the layout peft writes for the transformers model, they load with
`PeftModel.from_pretrained` on transformers' DiffusionGemma and give exactly dgemma's logits with the adapter applied;
`dgemma export` merges an adapter into a plain checkpoint that transformers loads with the same logits; an adapter
that does not fit the checkpoint is one error naming file, key and shapes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dgemma
from dgemma import cli
from dgemma.testing.hf import build_hf_checkpoint, hf_logits, load_hf_model
from dgemma.weights import lora
from tests.helpers import randomize_adapter_

peft = pytest.importorskip("peft")

TINY = dgemma.preset("tiny")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    build_hf_checkpoint(TINY, path, seed=3)
    return path


def adapted(base, targets: str, seed: int = 0) -> tuple[dgemma.DiffusionGemma, object]:
    """The base with a LoRA on `targets` whose A and B are both random (B starts at zero: it would hide the delta)."""
    model = dgemma.load_model(base, dtype=torch.float32)
    return model, randomize_adapter_(model, 4, 8, targets, seed=seed, base=str(base))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(5, 500, (2, 11), generator=g), torch.randint(0, 512, (2, 16), generator=g)


@pytest.mark.parametrize("targets", ["attention", "attention+experts"])
def test_adapter_loads_in_peft_on_transformers_with_the_same_logits(tmp_path, base, targets):
    model, config = adapted(base, targets)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if ".lora_" in n}  # the base is frozen
    lora.save_adapter(model, config, tmp_path / "adapter")
    ids, canvas = inputs()
    ours = model(ids, canvas)
    assert float((ours - dgemma.load_model(base)(ids, canvas)).abs().max()) > 0.1  # the adapter does something

    hf = peft.PeftModel.from_pretrained(load_hf_model(base), tmp_path / "adapter")
    theirs, _ = hf_logits(hf.base_model.model, ids, canvas)
    assert torch.equal(ours, theirs)

    # The very keys (and config) peft saves for the same adapter on the transformers model.
    own = peft.get_peft_model(load_hf_model(base), lora.lora_config(4, 8, targets))
    own.save_pretrained(tmp_path / "peft")
    with safe_open(str(tmp_path / "adapter" / lora.WEIGHTS), "pt") as a, \
            safe_open(str(tmp_path / "peft" / lora.WEIGHTS), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())  # noqa: SIM118
    ours_cfg = json.loads((tmp_path / "adapter" / lora.CONFIG).read_text())
    assert ours_cfg["peft_type"] == "LORA" and ours_cfg["r"] == 4 and ours_cfg["base_model_name_or_path"] == str(base)


def test_export_merges_into_a_checkpoint_transformers_loads(tmp_path, base, capsys):
    model, config = adapted(base, "attention+experts", seed=2)
    lora.save_adapter(model, config, tmp_path / "adapter")
    ids, canvas = inputs()
    with_adapter = model(ids, canvas)
    assert cli.main(["export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    assert "merged into" in capsys.readouterr().out
    merged = dgemma.load_model(tmp_path / "merged")  # a plain checkpoint: no adapter left
    assert not lora.has_lora(merged)
    theirs, _ = hf_logits(load_hf_model(tmp_path / "merged"), ids, canvas)
    assert torch.equal(merged(ids, canvas), theirs)  # transformers computes what dgemma does on it
    torch.testing.assert_close(theirs, with_adapter, rtol=0, atol=1e-4)  # W + s B A folded once (rounding only)


def test_an_adapter_that_does_not_fit_is_one_error(tmp_path, base, capsys):
    model, config = adapted(base, "attention")
    lora.save_adapter(model, config, tmp_path / "adapter")
    other = tmp_path / "other"
    build_hf_checkpoint(TINY.replace(hidden_size=32), other, seed=0)
    file = tmp_path / "adapter" / lora.WEIGHTS
    with pytest.raises(lora.AdapterError, match=r"adapter_model\.safetensors: does not fit this model.*"
                                                r"layers\.\d\.self_attn\.\w_proj\.lora_\w\.weight has shape"):
        dgemma.load_model(tmp_path / "adapter", base=other)
    capsys.readouterr()  # what building the checkpoints printed
    assert cli.main(["export", str(tmp_path / "adapter"), "--base", str(other), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(file) in err[0] and "has shape" in err[0]

    # Encoder and decoder copies that differ cannot be one dgemma LoRA.
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    key = next(k for k in tensors if ".encoder." in k)
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(file))
    with pytest.raises(lora.AdapterError, match="differs from its decoder copy"):
        dgemma.load_model(tmp_path / "adapter")
