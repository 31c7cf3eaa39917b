"""Prefix caching across requests: the committed K/V of prompt blocks, kept after their request ends and copied into
the row of a later request whose prompt starts with the same tokens (a shared system prompt, the earlier turns of a
chat).

    prompt    [ block 0 | block 1 | block 2 | rest ]       blocks of `block_size` tokens
    digest    d0 = H(namespace, block 0), d1 = H(d0, block 1), ...   a block's digest covers every token before it
    lookup    the longest run of leading blocks whose digests are stored -> copied into the row, the rest prefilled

Token identity, by construction. With a prefix cache the engine prefills every prompt in block-aligned chunks
(`chunks`): block k is committed on its own, attending to the blocks before it. A position's K/V then depends on
exactly the tokens its block's digest covers, computed by exactly the same ops, so a stored block holds bit for bit
what the request would have computed itself, and a request's tokens are the same whether its prefix came from the
cache or not (tests/serving/test_prefix_cache.py). (Prefilling a prompt whole instead would give K/V that differ from
the chunked ones in the last bits, so a cached prefix would change tokens now and then; this is why the chunking is part
of the rule rather than a speed choice.)

The store is a fixed pool of `capacity` blocks (every layer's keys and values, as the engine's pool), bounded when it
is made, with least-recently-used eviction: a lookup or a store marks its blocks as used, children before parents, so
a chain is evicted from its end. `namespace` keeps apart K/V that different weights computed (a LoRA adapter's name;
`drop(namespace)` forgets them when the adapter goes).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dgemma.model.config import ModelConfig
from dgemma.model.kv_cache import KVCache

DEFAULT_BLOCK_SIZE = 256  # tokens: chunks this long prefill as fast as a whole prompt on a CPU (docs/benchmarks.md)


@dataclass(frozen=True)
class PrefixStats:
    """Cumulative counters in prompt tokens (vLLM's `prefix_cache_queries` / `prefix_cache_hits`), and gauges."""

    queries: int  # prompt tokens looked up
    hits: int  # of those, served from the cache
    blocks: int  # blocks stored now
    capacity: int  # blocks the store holds
    evictions: int  # blocks evicted to make room


class PrefixCache:
    """`capacity` blocks of `block_size` committed tokens each, for a model of `config` in `dtype` on `device`."""

    def __init__(self, config: ModelConfig, capacity: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        for name, value in (("capacity", capacity), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prefix cache {name} must be a positive int, got {value!r}")
        self.block_size, self.capacity = block_size, capacity
        # The blocks live as the rows of a cache of `capacity` rows, each `block_size` slots long.
        self.store = KVCache(config, capacity, block_size, dtype=dtype, device=device)
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # digest -> store row, least recently used first
        self._namespace: dict[bytes, str] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._queries = self._hits = self._evictions = 0

    def stats(self) -> PrefixStats:
        return PrefixStats(self._queries, self._hits, len(self._slot), self.capacity, self._evictions)

    def chunks(self, start: int, length: int) -> Iterator[tuple[int, int]]:
        """The spans [a, b) in which a prompt of `length` tokens is prefilled from `start` (a block boundary): one per
        block, the last one partial."""
        for a in range(start, length, self.block_size):
            yield a, min(a + self.block_size, length)

    def digests(self, tokens: Sequence[int], namespace: str = "") -> list[bytes]:
        """The digest of each whole block of `tokens`; each covers its block and every block before it."""
        out: list[bytes] = []
        parent = hashlib.blake2b(namespace.encode(), digest_size=16, person=b"dgemma-prefix").digest()
        B = self.block_size
        for k in range(len(tokens) // B):
            block = np.asarray(tokens[k * B:(k + 1) * B], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            out.append(parent)
        return out

    def load(self, tokens: Sequence[int], row: KVCache, namespace: str = "") -> int:
        """Copy the longest cached run of leading blocks of `tokens` into the one-row cache `row` (from slot 0) and
        set its length; returns the number of tokens it holds (0: a miss, `row` untouched)."""
        self._queries += len(tokens)
        hit = []
        for d in self.digests(tokens, namespace):
            if d not in self._slot:
                break
            hit.append(d)
        self._touch(hit)
        n = len(hit) * self.block_size
        if hit:
            slots = torch.tensor([self._slot[d] for d in hit], device=self.store.is_token.device)
            for dst, src in ((row.keys, self.store.keys), (row.values, self.store.values)):
                for r, s in zip(dst, src, strict=True):  # (blocks, K, B, Dh) -> (1, K, blocks * B, Dh)
                    r[:, :, :n] = s[slots].transpose(0, 1).reshape(1, s.shape[1], n, s.shape[3])
            row.is_token[:, :n] = True
            row.length = n
        self._hits += n
        return n

    def save(self, tokens: Sequence[int], row: KVCache, namespace: str = "") -> int:
        """Store the whole blocks of `tokens` that `row` holds (committed from slot 0 in `chunks`) and the cache
        lacks, evicting the least recently used blocks of other prompts to make room; returns the blocks added."""
        chain = self.digests(tokens[:row.length], namespace)[:self.capacity]
        new = [(k, d) for k, d in enumerate(chain) if d not in self._slot]
        keep = set(chain)
        for k, d in new:
            if not self._free:
                victim = next((v for v in self._slot if v not in keep), None)
                if victim is None:
                    break
                self._free.append(self._slot.pop(victim))
                del self._namespace[victim]
                self._evictions += 1
            slot = self._free.pop()
            B = self.block_size
            for dst, src in ((self.store.keys, row.keys), (self.store.values, row.values)):
                for s, r in zip(dst, src, strict=True):
                    s[slot] = r[0, :, k * B:(k + 1) * B]
            self._slot[d] = slot
            self._namespace[d] = namespace
        self._touch([d for d in chain if d in self._slot])
        return sum(d in self._slot for _, d in new)

    def drop(self, namespace: str) -> int:
        """Forget every block computed under `namespace`; returns how many."""
        gone = [d for d, ns in self._namespace.items() if ns == namespace]
        for d in gone:
            self._free.append(self._slot.pop(d))
            del self._namespace[d]
        return len(gone)

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain as just used, its end first: its leading blocks outlive its tail."""
        for d in reversed(chain):
            self._slot.move_to_end(d)
