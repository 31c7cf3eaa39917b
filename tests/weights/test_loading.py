"""The library loader (dgemma/weights/loading.py) does what the CLI's --model / --preset --random-init / --quantize /
--offload-experts do: `dgemma.load_model` takes a LoRA adapter (merged into its base) as `dgemma generate --model`
does, `dgemma.build_model` a preset with random weights; quantization and offload are declared attributes of the
model, and the rule that they do not combine has one home (offload.check_offload_combination)."""

from __future__ import annotations

import re

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.weights import lora

peft = pytest.importorskip("peft")
TINY = dgemma.preset("tiny")


def test_load_model_merges_a_lora_adapter_as_the_cli_does(tmp_path, capsys):
    base = tmp_path / "base"
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), base)
    model = dgemma.load_model(base)
    config = lora.lora_config(4, 8, "attention", str(base))
    lora.attach(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.fill_(0.05)
    lora.save_adapter(model, config, tmp_path / "adapter")
    merged = dgemma.load_model(tmp_path / "adapter")
    want = lora.load_merged(tmp_path / "adapter")
    assert not lora.has_lora(merged)
    for (name, x), (_, y) in zip(merged.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    q_proj = lambda m: m.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj(merged), q_proj(dgemma.load_model(base)))
    # The CLI loads the same thing through the same call.
    assert cli.main(["generate", "--model", str(tmp_path / "adapter"), "--prompt-ids", "2,3", "--max-new-tokens",
                     "4", "--max-denoising-steps", "2", "--seed", "0"]) == 0


def test_build_model_is_the_random_preset_model():
    model = dgemma.build_model("tiny")
    assert model.config == TINY and not model.training
    assert model.quantization is None and model.offloaded is None
    assert model.generation_config == dgemma.GenerationConfig.for_model(TINY)


def test_quantize_and_offload_do_not_combine_by_one_rule(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"quantize='int8' \(--quantize\) and offload_experts \(--offload-experts\) "
                                         r"do not combine"):
        dgemma.build_model("tiny", quantize="int8", offload_experts=True)
    assert cli.main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,3", "--quantize", "int8",
                     "--offload-experts"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"dgemma generate: error: .*do not combine", err[0]), err


def test_a_fresh_model_declares_its_modes():
    model = dgemma.DiffusionGemma(TINY)
    assert (model.quantization, model.offloaded, model.generation_config) == (None, None, None)


def test_offloaded_experts_are_written_atomically_never_through_a_symlink(tmp_path):
    """The experts file goes through the one atomic writer (fsio.atomic_write): a symlink at the path is replaced,
    the file it pointed to is untouched."""
    from dgemma.weights.offload import offload_experts

    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    link = tmp_path / "experts.safetensors"
    link.symlink_to(victim)
    model = dgemma.build_model("tiny")
    want = model(torch.tensor([[2, 3, 4]]), torch.tensor([[5] * TINY.canvas_length]))
    offload_experts(model, link)
    assert victim.read_text() == "not yours" and not link.is_symlink() and link.is_file()
    assert model.offloaded == str(link)
    assert torch.equal(model(torch.tensor([[2, 3, 4]]), torch.tensor([[5] * TINY.canvas_length])), want)
