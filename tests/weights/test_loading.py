"""The library loader (dgemma/weights/loading.py) does what the CLI's --model / --preset --random-init / --quantize /
--offload-experts do: `dgemma.load_model` takes a LoRA adapter (merged into its base) as `dgemma generate --model`
does, `dgemma.build_model` a preset with random weights. The model stays a pure module: its generation settings travel
beside it (`dgemma.load_generation_config`), its quantization and offload are read off its modules
(`quantize.quantization_of`, `offload.offloaded_to`), and the rule of what combines has one home
(offload.check_combination)."""

from __future__ import annotations

import re

import pytest
import torch

import dgemma
from dgemma import cli
from dgemma.weights import lora
from dgemma.weights.offload import offloaded_to
from dgemma.weights.quantize import quantization_of

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
    settings = dgemma.GenerationConfig(eos_token_id=(1, 7), pad_token_id=0, max_denoising_steps=3)
    lora.save_adapter(model, config, tmp_path / "adapter", settings)
    merged = dgemma.load_model(tmp_path / "adapter")
    want = dgemma.load_model(base)
    lora.load_adapter(want, tmp_path / "adapter")
    want = lora.merge(want)
    assert not lora.has_lora(merged)
    for (name, x), (_, y) in zip(merged.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    q_proj = lambda m: m.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj(merged), q_proj(dgemma.load_model(base)))
    # The adapter's generation_config.json, else its base's (transformers' defaults there: none was written)
    assert dgemma.load_generation_config(tmp_path / "adapter") == settings
    assert dgemma.load_generation_config(base) == dgemma.GenerationConfig()
    (tmp_path / "adapter" / "generation_config.json").unlink()
    assert dgemma.load_generation_config(tmp_path / "adapter") == dgemma.GenerationConfig()
    # The CLI loads the same thing through the same call.
    assert cli.main(["generate", "--model", str(tmp_path / "adapter"), "--prompt-ids", "2,3", "--max-new-tokens",
                     "4", "--max-denoising-steps", "2", "--seed", "0"]) == 0


def test_build_model_is_the_random_preset_model():
    model = dgemma.build_model("tiny")
    assert model.config == TINY and not model.training
    assert quantization_of(model) is None and offloaded_to(model) is None


def test_quantize_and_offload_do_not_combine_by_one_rule(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"quantize='int8' \(--quantize\) and offload_experts \(--offload-experts\) "
                                         r"do not combine"):
        dgemma.build_model("tiny", quantize="int8", offload_experts=True)
    assert cli.main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "2,3", "--quantize", "int8",
                     "--offload-experts"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"dgemma generate: error: .*do not combine", err[0]), err


def test_the_model_carries_no_loading_state_and_the_modes_are_read_off_its_modules(tmp_path):
    """Quantization, offload and generation settings are never attributes of the model: load_model(quantize=,
    offload_experts=) leaves none of them on it, and `quantization_of` / `offloaded_to` report what was done."""
    pytest.importorskip("torchao")
    ckpt = tmp_path / "ckpt"
    settings = dgemma.GenerationConfig(eos_token_id=(1, 4), pad_token_id=0, max_denoising_steps=7)
    dgemma.save_pretrained(dgemma.init_weights(dgemma.DiffusionGemma(TINY)), ckpt, generation_config=settings)
    plain = dgemma.load_model(ckpt)
    quantized = dgemma.load_model(ckpt, quantize="int8")
    offloaded = dgemma.load_model(ckpt, offload_experts=True)
    for model in (dgemma.DiffusionGemma(TINY), plain, quantized, offloaded):
        found = [a for a in ("generation_config", "quantization", "offloaded", "from_pretrained", "save_pretrained")
                 if hasattr(model, a)]
        assert not found, found
    assert (quantization_of(plain), offloaded_to(plain)) == (None, None)
    assert (quantization_of(quantized), offloaded_to(quantized)) == ("int8", None)
    assert (quantization_of(offloaded), offloaded_to(offloaded)) == (None, str(ckpt / "model.safetensors"))
    assert dgemma.load_generation_config(ckpt) == settings
    (ckpt / "generation_config.json").unlink()  # none: transformers' defaults with the model's special tokens
    assert dgemma.load_generation_config(ckpt) == dgemma.GenerationConfig.for_model(TINY)


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
    assert offloaded_to(model) == str(link)
    assert torch.equal(model(torch.tensor([[2, 3, 4]]), torch.tensor([[5] * TINY.canvas_length])), want)
