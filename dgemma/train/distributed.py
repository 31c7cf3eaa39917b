"""Training on several processes (`torchrun`): the process group, data-parallel wrapping (DDP or FSDP2), agreement
of the ranks on errors, and sharded checkpoints (`torch.distributed.checkpoint`). `dgemma/train/loop.py` runs one loop
for every world size; a `Dist` says which rank it is and does what differs. World size 1 (a plain `dgemma train`)
is `Dist()`: no process group, no wrapping, the single-file checkpoints of dgemma/train/run_dir.py.

    Dist.from_env(device)        torchrun's RANK / LOCAL_RANK / WORLD_SIZE -> the process group (gloo on the CPU,
                                 NCCL on CUDA) and this rank's device; WORLD_SIZE unset or 1: a single process
    dist.wrap(model, ...)        LossModule(model) (its forward is the training loss), under DDP or FSDP2 (fully_shard
                                 per block, then the root; bf16 mixed precision on CUDA; optional activation
                                 checkpointing per block), or with the routed experts split over the ranks (ep:
                                 dgemma/parallel/experts.py; every rank reads the same batch, one data replica), or
                                 both on a (data, ep) mesh (ddp+ep, fsdp+ep: dgemma/train/expert_parallel.py)
    dist.agree(fn)               run fn on every rank; a failure anywhere becomes a failure everywhere, shown once
    save_sharded / load_into     checkpoints: world size > 1 writes torch.distributed.checkpoint shards (any world
                                 size reads them back, resharded); the last one also gets the consolidated weights

Data and noise are split by rows: micro-batch m of a run is the same `batch_size x world_size` windows, and the same
random draws, whatever the number of ranks (dgemma/data/shards.py `TokenDataset.batches`, `diffusion.training_loss`'s
`batch_rows`), so W ranks x batch B compute what one process with batch W x B does, to fp32 rounding.

A sharded checkpoint, RUN/checkpoints/step-XXXXXXX/:

    .metadata, __<rank>_0.distcp    model and AdamW state by parameter name (DCP; DTensor shards under FSDP)
    trainer_state.json              step, tokens, elapsed_s, world_size
    train_config.json, config.json, generation_config.json, tokenizer.json
    model.safetensors               only in the run's last checkpoint: the consolidated weights (`save_pretrained`)

Every rank writes its shards into one temporary directory; rank 0 publishes it by renaming once DCP has written
its metadata (which it does after every rank's files are written), so a `step-*` directory is complete, as for a
single process. The run directory needs a filesystem every rank sees.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dgemma.io import fsio, quiet
from dgemma.io.dirkind import SHARDED_STATE, STATE
from dgemma.model import kernels, plan
from dgemma.model.config import ConfigError, ModelConfig, read_json
from dgemma.model.diffusiongemma import DiffusionGemma
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.train import expert_parallel, run_dir
from dgemma.weights.checkpoint import MODEL_FILES, resolve_model_dir, save_pretrained
from dgemma.weights.loading import load_generation_config, load_model

T = TypeVar("T")
PARALLEL = plan.TRAIN_LAYOUTS
SHARED = "dgemma_shared_by_all_ranks"  # set on an exception every rank raises alike: only rank 0 prints it
DEFAULT_TIMEOUT_MIN = 30.0  # minutes a collective may wait for the other ranks (DGEMMA_DIST_TIMEOUT_MIN overrides)


def process_group_timeout() -> datetime.timedelta:
    """How long a collective waits for the other ranks: DGEMMA_DIST_TIMEOUT_MIN minutes (default 30), read when the
    process group starts (not at import, so a caller that sets it before training is heard)."""
    raw = os.environ.get("DGEMMA_DIST_TIMEOUT_MIN", str(DEFAULT_TIMEOUT_MIN))
    try:
        minutes = float(raw)
    except ValueError:
        minutes = math.nan
    if not 0 < minutes < math.inf:
        raise ValueError(f"DGEMMA_DIST_TIMEOUT_MIN must be a number of minutes > 0, got {raw!r}")
    return datetime.timedelta(minutes=minutes)


# What gloo and NCCL say when a peer's process is gone.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
             "NCCL communicator was aborted", "Socket Timeout", "Connection refused")


class PeerFailed(ValueError):
    """Raised on the ranks whose peer failed: the CLI exits 2, and only rank 0 prints it (one line)."""


setattr(PeerFailed, SHARED, True)


def shared(e: BaseException) -> BaseException:
    """Mark `e` as raised alike by every rank (from values they agree on), so that only rank 0 prints it."""
    setattr(e, SHARED, True)
    return e


def should_print(e: BaseException) -> bool:
    """Whether this process shows `e`: always in a single process; in a torchrun job, rank 0 shows every error, the
    other ranks only their own (a PeerFailed or an error every rank raised alike is rank 0's to show)."""
    return int(os.environ.get("RANK", "0")) == 0 or not getattr(e, SHARED, False)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """"auto" | "cpu" | "cuda" -> the device of this rank (cuda:LOCAL_RANK under torchrun)."""
    cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device: 'cuda' but no CUDA device is available")
    if cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s): start at most "
                         "that many processes per node (torchrun --nproc-per-node)")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


class LossModule(nn.Module):
    """The model with the training loss as its forward, so DDP and FSDP2 see one forward per micro-batch (their
    hooks run on forward): `loss_fn(model, x0, **kw)` returns a LossOutput; forward returns (loss, that output).
    `measure`: an evaluation function `measure(model, x0, **kw)` run in the loss's place (FSDP2 gathers the
    parameters in forward); forward then returns (what it returns, None)."""

    def __init__(self, model: DiffusionGemma, loss_fn: Callable[..., Any]):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x0: torch.Tensor, measure: Callable[..., Any] | None = None, **kw: Any) -> tuple[Any, Any]:
        if measure is not None:
            return measure(self.model, x0, **kw), None
        out = self.loss_fn(self.model, x0, **kw)
        return out.loss, out


@dataclass
class Dist:
    """Which process of the job this is. `Dist()` is a single process (world size 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    parallel: str = "ddp"
    ep_size: int | None = None  # ddp+ep, fsdp+ep: the ranks that split the experts (plan.train_mesh)
    _mesh: Any = field(default=None, repr=False)

    @classmethod
    def from_env(cls, device: str = "auto") -> Dist:
        """This process's place in a torchrun job (the process group is created here), or a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        dev = resolve_device(device, local if world > 1 else 0)
        if world > 1:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=process_group_timeout(),
                                    device_id=dev if dev.type == "cuda" else None)
        return cls(rank, world, local, dev)

    @property
    def layout(self) -> plan.TrainMesh:
        """This job's (data, ep) mesh: `data` replicas of `ep` ranks that split the experts."""
        return plan.train_mesh(self.parallel, self.world_size, self.ep_size)

    @property
    def data_world(self) -> int:
        """Data replicas: the ranks that each read their own rows of a micro-batch (ep: one; its ranks share them)."""
        return self.layout.data

    @property
    def data_rank(self) -> int:
        return self.layout.data_rank(self.rank)

    @property
    def splits_experts(self) -> bool:
        """Whether each rank holds only its share of the routed experts (ep, ddp+ep, fsdp+ep on ep > 1 ranks)."""
        return self.layout.ep > 1

    def expert_mesh(self) -> Any:
        """The (data, ep) DeviceMesh, made once (every rank makes it at the same point: `wrap`)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.layout.data, self.layout.ep)
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("data", "ep"))
        return self._mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the job: collect what still references the process group (FSDP's sharded tensors sit in reference
        cycles), then destroy it while the interpreter is whole; gloo's worker threads abort the process if they
        are torn down at interpreter exit instead."""
        if self.world_size > 1 and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    # --- agreement -------------------------------------------------------------------------------------------

    def agree(self, fn: Callable[[], T]) -> T:
        """fn() on every rank. If it raises on any rank, it raises on every rank: the lowest failing rank its own
        exception, the others PeerFailed naming it; so every rank takes the same branch afterwards."""
        if self.world_size == 1:
            return fn()
        try:
            result, error = fn(), None
        except Exception as e:  # every failure has to reach the other ranks before anyone raises
            result, error = None, e
        outcomes: list[str | None] = [None] * self.world_size
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
        first = next((r for r, o in enumerate(outcomes) if o is not None), None)
        if first is None:
            return result  # type: ignore[return-value]
        if first == self.rank:
            assert error is not None
            raise error
        raise PeerFailed(f"rank {first} failed: {outcomes[first]}")

    def on_main(self, fn: Callable[[], T]) -> T | None:
        """fn() on rank 0 only, agreed on (a failure there stops every rank)."""
        return self.agree(lambda: fn() if self.is_main else None)

    def same_everywhere(self, what: str, value: Any) -> None:
        """Refuse (on every rank) a `value` that is not the same on every rank, e.g. the data's fingerprint."""
        if self.world_size == 1:
            return
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            raise shared(ValueError(f"{what} differs between rank 0 and rank(s) {odd}: every rank must read the "
                                    "same data (check each node's copy)"))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (fp64, on this rank's device)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # --- the model -------------------------------------------------------------------------------------------

    def wrap(self, model: DiffusionGemma, loss_fn: Callable[..., Any], *, parallel: str = "ddp",
             use_bf16: bool = False, activation_checkpointing: bool = False, compile: bool = False,
             fill_from: str | None = None) -> nn.Module:
        """The module the loop calls: LossModule(model), with each block compiled (CUDA) or checkpointed, and for
        world size > 1 under DDP (replicas, gradients all-reduced) or FSDP2 (parameters, gradients and AdamW state
        sharded per block). `fill_from` (FSDP, `model` on the meta device: `meta_model`): once sharded, each rank
        allocates its shards and fills them from that checkpoint, which rank 0 alone reads and broadcasts."""
        if parallel not in PARALLEL:
            raise ValueError(f"TrainConfig.parallel: must be one of {', '.join(PARALLEL)}, got {parallel!r}")
        self.parallel = parallel
        net = LossModule(model, loss_fn)
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint

            for block in model.layers:
                checkpoint(block)
        if self.world_size > 1 and "ep" in parallel.split("+"):
            try:
                expert_parallel.shard_experts(model, self)
            except ConfigError as e:
                raise shared(e) from None
        if self.sharded:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else None
            kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
            # fsdp+ep: the split experts stay this rank's own (their gradients averaged over the data replicas in
            # clip_grad_norm); FSDP shards the rest over every rank, whose reduce-scatter averages over the world:
            # over the data replicas, since an expert-parallel group's ranks hold the same gradients
            kw["ignored_params"] = set(expert_parallel.expert_params(model)) or None
            for block in model.layers:
                fully_shard(block, **kw)
            fully_shard(net, **kw)  # the root: embedding (tied head), final norm, self-conditioning
            quiet.fsdp_view_outputs()  # a false alarm for dgemma's modules (dgemma/io/quiet.py)
            if fill_from is not None:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                model.to_empty(device=self.device)
                full = load_model(fill_from, dtype=torch.float32).state_dict() if self.is_main else {}
                set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                           broadcast_from_rank0=True))
        elif fill_from is not None:
            raise ValueError("fill_from is for FSDP with several ranks (each rank fills its own shards)")
        if compile:
            kernels.register_expert_loop_op()  # the self-conditioning pre-pass's experts (no gradients): one op
            for block in model.layers:  # per block; corruption, masks and the loss stay eager (seed 003, section 5)
                block.compile()
        if self.world_size > 1 and parallel.startswith("ddp") and not self.splits_experts:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Self-conditioning's parameters sit out the steps that skip it: find_unused_parameters.
            # Buffers (the layer scalars) are constants, the same on every rank: no broadcast in each forward, which
            # would also make every rank's forward a collective (evaluation runs forwards without gradients).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
                net = DistributedDataParallel(net, device_ids=ids, find_unused_parameters=True,
                                              broadcast_buffers=False)
        return net

    @contextlib.contextmanager
    def accumulating(self, net: nn.Module, sync: bool) -> Iterator[None]:
        """A micro-batch's backward: gradients are reduced across ranks only when `sync` (the step's last)."""
        if self.world_size == 1 or (self.splits_experts and not self.sharded):  # ep, ddp+ep: reduced when clipped
            yield
        elif self.parallel.startswith("ddp"):  # (ddp+ep with an ep size of 1: plain DDP)
            with contextlib.nullcontext() if sync else net.no_sync():
                yield
        else:
            net.set_requires_gradient_sync(sync)
            yield

    def clip_grad_norm(self, model: nn.Module, clip: float) -> float:
        """The global gradient norm (before clipping), the same on every rank; clipped to `clip` (0: not)."""
        if self.splits_experts:
            return expert_parallel.clip_grad_norm(model, clip, self)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def rows(self, batch_size: int) -> tuple[int, int] | None:
        """(first row, rows in all) of this rank's share of a global micro-batch; None for a single process."""
        return None if self.data_world == 1 else (self.data_rank * batch_size, self.data_world * batch_size)

    def symmetric(self, fn: Callable[[], T]) -> T:
        """fn(), which every rank runs alike on agreed values: an error it raises is rank 0's to show."""
        try:
            return fn()
        except Exception as e:
            shared(e)
            raise

    def save_checkpoint(self, run: Path, model: DiffusionGemma, optimizer: torch.optim.Optimizer,
                        train_config: dict[str, Any], keep_last: int, state: dict[str, Any], last: bool,
                        generation_config: GenerationConfig, write_weights: Callable[[Path], None] | None = None
                        ) -> Path:
        """One process: run_dir.save_checkpoint (the Hugging Face layout with `generation_config`, or what
        `write_weights` writes: a LoRA run's adapter, + trainer_state.pt); several ranks: save_sharded, with the
        consolidated weights in the `last` one."""
        if self.world_size == 1:
            return run_dir.save_checkpoint(run, model, optimizer, train_config, keep_last, state, generation_config,
                                           write_weights=write_weights)
        if write_weights is not None:
            raise ValueError("LoRA checkpoints are written by one process only (several ranks: not supported yet)")
        return save_sharded(self, run, model, optimizer, train_config, keep_last, state, generation_config,
                            consolidate=last)

    @contextlib.contextmanager
    def peers_lost(self) -> Iterator[None]:
        """A collective that fails because another rank died (its error, if any, is in its own log; torchrun stops
        this rank next) becomes one line, PeerFailed, instead of a communication library's traceback."""
        try:
            yield
        except RuntimeError as e:
            if self.world_size == 1 or not any(m in str(e) for m in LOST_PEER):
                raise
            raise PeerFailed(f"rank {self.rank} stopped: lost contact with another rank, which failed or was killed "
                             f"(its own error, if it printed one, is above); resume with the same command") from None

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the parameters (fsdp, fsdp+ep: all but the split experts)."""
        return self.world_size > 1 and self.parallel.startswith("fsdp")


def windows_per_step(cfg: Any, world: int) -> int:
    """Training windows an optimizer step reads, over all ranks."""
    return cfg.batch_size * cfg.grad_accum * world


def rescale_for_world(cfg: Any, saved_world: int, world: int) -> Any:
    """A run's TrainConfig for `world` ranks when it was trained on `saved_world`: the same micro-batch in all (so the
    same windows and noise, to rounding) when batch_size divides, else the same windows per step via grad_accum."""
    total = windows_per_step(cfg, saved_world)
    if world == saved_world:
        return cfg
    if cfg.batch_size * saved_world % world == 0:
        return cfg.replace(batch_size=cfg.batch_size * saved_world // world)
    if total % (cfg.batch_size * world) == 0:
        return cfg.replace(grad_accum=total // (cfg.batch_size * world))
    raise ConfigError(f"the run was trained on {saved_world} rank(s) with {total} windows per step (batch_size "
                      f"{cfg.batch_size} x grad_accum {cfg.grad_accum}); {world} rank(s) cannot split that: pass "
                      f"--batch-size and --grad-accum with batch_size x grad_accum x {world} = {total}")


# --- checkpoints ---------------------------------------------------------------------------------------------------

def meta_model(path: str | os.PathLike[str], impl: str = "reference") -> DiffusionGemma:
    """The model of checkpoint `path` on the meta device (no memory): to be sharded and filled by
    `Dist.wrap(..., fill_from=path)`."""
    ckpt = resolve_model_dir(path)
    config = ModelConfig.from_hf(read_json(ckpt / "config.json"), source=str(ckpt / "config.json"))
    with torch.device("meta"):
        return DiffusionGemma(config, impl=impl)  # type: ignore[arg-type]


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def data_world(parallel: str, world_size: int, ep_size: int | None = None) -> int:
    """Data replicas of `world_size` ranks under `parallel` (ep: one; ddp+ep, fsdp+ep: world_size / ep_size)."""
    return plan.train_mesh(parallel, world_size, ep_size).data


def resumed_config(base: Any, record: dict[str, Any], given: dict[str, Any]) -> Any:
    """A recorded run's TrainConfig `base` for this torchrun job (WORLD_SIZE) and the flags `given`: a --parallel
    given without --ep-size brings its own (the recorded one is dropped); the same windows per step on another
    number of data replicas unless --batch-size or --grad-accum is given (`rescale_for_world`)."""
    if "parallel" in given and "ep_size" not in given:
        base = base.replace(ep_size=None)
    if "batch_size" in given or "grad_accum" in given:
        return base
    world, now = int(os.environ.get("WORLD_SIZE", "1")), {"parallel": base.parallel, "ep_size": base.ep_size} | given
    return rescale_for_world(base, recorded_data_world(record), data_world(now["parallel"], world, now["ep_size"]))


def recorded_data_world(record: dict[str, Any]) -> int:
    """The data replicas a run.json / trainer state records (`data_world`; before ep, `world_size` was that)."""
    return int(record.get("data_world", record.get("world_size", 1)))


def checkpoint_world_size(ckpt: Path) -> int:
    """How many ranks wrote checkpoint `ckpt` (1 for a single process's)."""
    return recorded_data_world(read_json(Path(ckpt) / SHARDED_STATE)) if is_sharded_checkpoint(ckpt) else 1


def _nonfinite(sd: dict[str, Any]) -> str | None:
    def local(v: Any) -> Any:
        if hasattr(v, "to_local"):
            return v.to_local()
        if isinstance(v, dict):
            return {k: local(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [local(x) for x in v]
        return v

    return run_dir.nonfinite_tensor(iter(local(sd).items()))


def save_sharded(d: Dist, run: Path, model: DiffusionGemma, optimizer: torch.optim.Optimizer,
                 train_config: dict[str, Any], keep_last: int, state: dict[str, Any],
                 generation_config: GenerationConfig, consolidate: bool) -> Path:
    """Write checkpoints/step-XXXXXXX with torch.distributed.checkpoint from every rank, published atomically by rank
    0 (temporary directory, rename, `latest`, pruning), as run_dir.save_checkpoint does for one process. With
    `consolidate`, also the Hugging Face weights (gathered on rank 0): what `dgemma generate --model RUN` loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    msd, osd = expert_parallel.as_dtensors(d, model, *get_state_dict(model, optimizer))
    d.agree(lambda: _refuse_nonfinite(state["step"], {"model": msd, "optimizer": osd}))
    final, tmp = run_dir.checkpoint_paths(run, state["step"], "sharded")
    d.on_main(lambda: run_dir.fresh_dir(tmp))
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp)
    if not consolidate:
        full = None
    elif d.splits_experts:  # every rank gathers the experts (rank 0 writes them)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in msd.items()}
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # a single process's checkpoint resumed here brought its optimizer and RNG states: DCP holds the optimizer's
    trainer_state = {k: v for k, v in state.items() if k not in ("optimizer", "rng_cpu", "rng_cuda")}

    def fill() -> None:
        if full is not None:
            with torch.device("meta"):
                plain = DiffusionGemma(model.config)
            plain.load_state_dict(full, assign=True)
            save_pretrained(plain, tmp, generation_config=generation_config)
        else:  # the configs, so that `dgemma export` knows the model (and load_model names the way out)
            fsio.write_text(tmp / "config.json", json.dumps(model.config.to_hf(), indent=2) + "\n")
            fsio.write_text(tmp / "generation_config.json", json.dumps(generation_config.to_hf(), indent=2) + "\n")
        fsio.write_text(tmp / SHARDED_STATE, json.dumps({**trainer_state, "world_size": d.world_size,
                                                         "data_world": d.data_world}) + "\n")

    publish = lambda: run_dir.publish_checkpoint(run, tmp, final, train_config, keep_last, fill,
                                                 needed=run_dir.tensor_bytes(full or {}))
    d.on_main(publish)
    return final


def _refuse_nonfinite(step: int, sd: dict[str, Any]) -> None:
    bad = _nonfinite(sd)
    if bad:
        raise run_dir.NonFiniteError(f"step {step}: {bad} has non-finite values; no checkpoint written")


def load_into(d: Dist, ckpt: Path, model: DiffusionGemma, optimizer: torch.optim.Optimizer,
              read_weights: Callable[[Path], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Load checkpoint `ckpt` (sharded, from any world size, or a single process's) into this rank's `model` and
    `optimizer`, resharded for this world size; returns its trainer state (step, tokens, elapsed_s, ...).
    `read_weights(ckpt)`: the tensors a single process's checkpoint holds, by `model`'s names (default: the whole
    model's); a LoRA run's are its adapter's, loaded into a model that holds the frozen base already."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if is_sharded_checkpoint(ckpt):
        import torch.distributed.checkpoint as dcp

        state = read_json(ckpt / SHARDED_STATE)
        # on a fresh optimizer: a stand-in state for every parameter (ep: the experts as DTensor shards)
        msd, osd = expert_parallel.as_dtensors(d, model, *get_state_dict(model, optimizer))
        # AdamW makes a parameter's state at its first gradient: a parameter with none yet (the self-conditioning
        # MLP before the first pre-pass) has no state in the checkpoint. Those are not asked for, and load_state_dict
        # drops their stand-ins, so the resumed optimizer is the one that was saved.
        saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        for fqn in [f for f in osd["state"] if f"optimizer.state.{f}.step" not in saved]:
            del osd["state"][fqn]
        sd = {"model": msd, "optimizer": osd}
        with _single_process_quiet():
            dcp.load(sd, checkpoint_id=ckpt)  # every model key is asked for: a missing one is an error here
        sd = expert_parallel.locals_of(d, model, sd)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"],
                       options=StateDictOptions(strict=False))  # not strict: the parameters without state
    else:
        try:
            state = torch.load(ckpt / STATE, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, corrupt, or not a torch file
            raise ValueError(f"{ckpt / STATE}: unreadable ({str(e).split('. ')[0]})") from None
        missing = {"step", "tokens", "elapsed_s", "optimizer", "rng_cpu"} - set(state)
        if missing:
            raise ValueError(f"{ckpt / STATE}: no {', '.join(sorted(missing))}")
        if read_weights is not None:  # part of the model (LoRA): every other tensor is already in place
            weights = {**model.state_dict(), **read_weights(ckpt)}
        else:
            weights = load_model(ckpt, dtype=torch.float32, device="cpu").state_dict()
        if d.splits_experts:  # each rank keeps its experts of the whole tensors
            weights, state["optimizer"] = expert_parallel.own_share(model, optimizer, weights, state["optimizer"])
        if d.sharded:  # FSDP: the full tensors, named, are scattered into this rank's shards
            named = _named_optimizer_state(model, optimizer, state["optimizer"])
            set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=named,
                           options=StateDictOptions(full_state_dict=True, strict=False))  # (as above)
            for name, p in model.named_parameters():  # no stand-in state (a zero step) where the saved has none
                if name not in named["state"]:
                    optimizer.state.pop(p, None)
        else:
            with torch.no_grad():
                model.load_state_dict(weights)
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng_cpu"])
            if d.device.type == "cuda" and state.get("rng_cuda"):
                torch.cuda.set_rng_state_all(state["rng_cuda"])
    missing = {"step", "tokens", "elapsed_s"} - set(state)
    if missing:
        raise ValueError(f"{ckpt}: trainer state has no {', '.join(sorted(missing))}")
    bad = _nonfinite(model.state_dict())
    if bad:
        raise run_dir.NonFiniteError(f"{ckpt}: {bad} has non-finite values")
    return state


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it loads in a single process when there is no process group: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
                           ) -> dict[str, Any]:
    """A torch optimizer state dict (parameters by index, in param-group order) keyed by parameter name instead."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {order[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


def export(ckpt: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write checkpoint `ckpt` (sharded or not) as a consolidated Hugging Face checkpoint in `out`, in one process.
    Peak memory: the whole model in fp32 (26B-A4B: ~101 GB)."""
    ckpt = Path(ckpt)
    if not is_sharded_checkpoint(ckpt):
        model = load_model(ckpt, dtype=dtype)
    else:
        import torch.distributed.checkpoint as dcp

        config = ModelConfig.from_hf(read_json(ckpt / "config.json"), source=str(ckpt / "config.json"))
        with torch.device("meta"):
            model = DiffusionGemma(config)
        model.to_empty(device="cpu")
        sd = {"model": model.state_dict()}
        with _single_process_quiet():
            dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd["model"])
        model = model.to(dtype)
    save_pretrained(model, out, generation_config=load_generation_config(ckpt))
    for name in MODEL_FILES:
        if (ckpt / name).is_file():
            fsio.copy_file(ckpt / name, Path(out) / name)
    return Path(out)
