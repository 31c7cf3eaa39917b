"""Small helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def traced_cli_settings(tmp_path, capsys, *flags: str) -> dict:
    """The generation settings the trace of a real `dgemma generate` on a random tiny model recorded: 16 new tokens
    after the ids 1,2 at seed 0, with the sampler `flags`."""
    import json

    from dgemma.cli import main

    trace = tmp_path / "t"
    main(["generate", "--preset", "tiny", "--random-init", "--prompt-ids", "1,2", "--max-new-tokens", "16", "--seed",
          "0", *flags, "--trace", str(trace)])
    capsys.readouterr()
    return json.loads(trace.with_suffix(".json").read_text())["generation_config"]


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids uniform in [0, vocab), of `shape`, reproducible from `seed`."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def model_config(name: str):
    """The dgemma-only test geometries of the fast-vs-readable tests: "tiny", and "k8-of-16" (like
    dgemma/testing/hf.py's: 16 experts top-8, six layers in the default 5:1 pattern, other RoPE)."""
    from dgemma.model.config import RopeConfig, preset

    if name == "tiny":
        return preset("tiny")
    if name == "k8-of-16":
        return preset("tiny").replace(num_experts=16, top_k_experts=8, num_hidden_layers=6, layer_types=(),
                                      sliding_rope=RopeConfig("default", 5_000.0),
                                      full_rope=RopeConfig("proportional", 200_000.0, 0.5))
    raise KeyError(f"no test geometry {name!r}")


GEOMETRY_NAMES = ("tiny", "k8-of-16")


def random_model(name: str, seed: int = 0):
    """A dgemma model of `model_config(name)` with every tensor randomised (dgemma.testing.hf.randomize_), eval."""
    from dgemma.model.diffusiongemma import DiffusionGemma
    from dgemma.testing.hf import randomize_

    return randomize_(DiffusionGemma(model_config(name)), seed).eval()


def random_init_model(name: str = "tiny", seed: int = 0):
    """A dgemma model of `model_config(name)` as `--random-init` builds it (dgemma's `init_weights` from `seed`),
    eval."""
    from dgemma.model.diffusiongemma import DiffusionGemma
    from dgemma.weights.loading import init_weights

    return init_weights(DiffusionGemma(model_config(name)), seed).eval()


def running_server(app):
    """A context manager: serve the ASGI `app` with uvicorn from a background thread on a free port of 127.0.0.1;
    yields its base URL ("http://127.0.0.1:PORT") and stops the server on exit."""
    import contextlib
    import socket
    import threading
    import time

    import uvicorn

    @contextlib.contextmanager
    def serving():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="test-server")
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(15)
            sock.close()

    return serving()


def randomize_adapter_(model: torch.nn.Module, rank: int, alpha: float, targets: str, *, seed: int = 0,
                       scale: float = 0.1, base: str | None = None) -> object:
    """Attach a LoRA of `rank` / `alpha` on `targets` (a key of `lora.TARGETS`) to `model` in place and fill every
    factor with `scale` x N(0, 1) from `seed`; returns its peft LoraConfig (for `lora.save_adapter`)."""
    from dgemma.weights import lora

    config = lora.lora_config(rank, alpha, targets, base)
    lora.attach(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return config


def after_each_training_step(fn):
    """A context manager: while it is open, `fn(kwargs, out)` runs after the forward of every training micro-step a
    trainer in this process takes, with the keyword arguments the trainer gave the loss (`generator`,
    `self_conditioning_prob`, ...) and the step's LossOutput, before its backward and update: `fn` may poison
    `out.loss`, or stall (a process to kill inside a step). The hook is torch's global forward hook on the module the
    trainer calls (dgemma/train/distributed.py:LossModule); held-out passes (the model in eval mode) are no steps."""
    import contextlib

    from torch.nn.modules.module import register_module_forward_hook

    from dgemma.train.distributed import LossModule

    def hook(module, args, kwargs, output):
        if isinstance(module, LossModule) and module.model.training and output[1] is not None:
            fn(kwargs, output[1])

    @contextlib.contextmanager
    def hooked():
        handle = register_module_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    return hooked()
