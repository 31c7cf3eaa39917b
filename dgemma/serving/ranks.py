"""`dgemma serve --parallel` under torchrun: rank 0 answers HTTP and runs the engine on a `Leader`, a stand-in for its
shard of the split model (dgemma/parallel/) that first broadcasts every call that runs the layers (a commit, a
denoising pass, a scoring pass) to the other ranks; they `follow`, replaying each call on their own shard with
their own KV caches (each rank's kv heads), so every collective inside the layers meets its peers. The samplers, the
head, the embedding and HTTP stay on rank 0 (they are replicated: rank 0 computes them alone).

    Leader(model).new_cache(B, T)     the cache, and the same on every follower (by a key)
    Leader(model).commit(ids, cache)  broadcast ("commit", ids, the cache as (key, first row, rows, length)), then
                                      the call; the same for denoise, denoise_hidden, next_token_logits,
                                      sequence_hidden, forward
    follow(model)                     the other ranks: replay until the leader stops

Calls are serialized by one lock (the engine's thread and the HTTP threads that score may call at once), so the
followers replay them in the leader's order. An idle server sends a no-op now and then, so the followers' wait never
reaches the process group's timeout. The prefix cache (which copies K/V outside the model) and LoRA adapters are not
supported here (cli/serve.py refuses them).
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from dgemma.model.kv_cache import KVCache, RowCaches

CALLS = ("commit", "denoise", "denoise_hidden", "next_token_logits", "sequence_hidden", "forward")
HEARTBEAT_S = 60.0


class _Cache:
    """A cache as the followers find theirs: pool `key`, rows [row, row + rows), committed `length`."""

    def __init__(self, key: int, row: int, rows: int, length: int):
        self.key, self.row, self.rows, self.length = key, row, rows, length


class _Rows:
    """`RowCaches` as the followers find theirs."""

    def __init__(self, rows: list[_Cache]):
        self.rows = rows


class Leader:
    """Rank 0's model: the split model's attributes, its layer-running calls broadcast first (module docstring)."""

    def __init__(self, model: Any):
        self._model, self._lock = model, threading.Lock()
        self._pools: dict[int, tuple[int, int]] = {}  # key -> (storage address, row stride) of a cache it made
        self._freed: queue.SimpleQueue[int] = queue.SimpleQueue()  # filled by finalizers, on any thread
        self._next = 0
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="dgemma-ranks", daemon=True)
        self._beat.start()

    def __getattr__(self, name: str) -> Any:
        if name in CALLS:
            return lambda *args, **kw: self._call(name, args, kw)
        return getattr(self._model, name)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        with self._lock:
            cache = self._model.new_cache(batch_size, max_length)
            key, self._next = self._next, self._next + 1
            self._send({"kind": "new", "key": key, "shape": (batch_size, max_length)})
            k = cache.keys[0]
            self._pools[key] = (k.untyped_storage().data_ptr(), k.stride(0))
            weakref.finalize(cache, self._free, key)
            return cache

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        if not self._stopped.is_set():
            self._stopped.set()
            with self._lock:
                self._send({"kind": "stop"})

    def _free(self, key: int) -> None:
        self._pools.pop(key, None)
        self._freed.put(key)

    def _heartbeat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            with self._lock:
                if not self._stopped.is_set():
                    self._send({"kind": "noop"})

    def _describe(self, value: Any) -> Any:
        if isinstance(value, RowCaches):
            return _Rows([self._describe(c) for c in value.rows])
        if isinstance(value, torch.Tensor):  # sent from the host: a follower's device is its own (cuda:LOCAL_RANK)
            return value.cpu()
        if not isinstance(value, KVCache):
            return value
        k = value.keys[0]
        for key, (address, stride) in reversed(self._pools.items()):  # the newest first
            if k.untyped_storage().data_ptr() == address:
                return _Cache(key, k.storage_offset() // stride, value.batch_size, value.length)
        raise ValueError("parallel serving: a KV cache the leader did not make (model.new_cache)")

    def _call(self, name: str, args: tuple, kw: dict[str, Any]) -> Any:
        with self._lock:
            self._send({"kind": name, "args": [self._describe(a) for a in args],
                        "kw": {k: self._describe(v) for k, v in kw.items()}})
            return getattr(self._model, name)(*args, **kw)

    def _send(self, op: dict[str, Any]) -> None:
        op["freed"] = []
        while not self._freed.empty():
            op["freed"].append(self._freed.get())
        dist.broadcast_object_list([op], src=0)


def follow(model: Any) -> None:
    """The other ranks: replay the leader's calls on this rank's shard until it stops. A call that fails here failed
    alike on rank 0 (the same inputs, the same checks), which answered it: the loop goes on."""
    pools: dict[int, KVCache] = {}

    def resolve(value: Any) -> Any:
        if isinstance(value, _Rows):
            return RowCaches([resolve(c) for c in value.rows])
        if isinstance(value, torch.Tensor):
            return value.to(model.device)
        if not isinstance(value, _Cache):
            return value
        pool = pools[value.key]
        view = pool if value.row == 0 and value.rows == pool.batch_size else pool.rows(value.row,
                                                                                          value.row + value.rows)
        view.length = value.length
        return view

    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op = box[0]
        for key in op["freed"]:
            pools.pop(key, None)
        if op["kind"] == "stop":
            return
        if op["kind"] == "new":
            pools[op["key"]] = model.new_cache(*op["shape"])
        elif op["kind"] in CALLS:
            try:
                with torch.no_grad():
                    getattr(model, op["kind"])(*[resolve(a) for a in op["args"]],
                                               **{k: resolve(v) for k, v in op["kw"].items()})
            except ValueError:
                pass
