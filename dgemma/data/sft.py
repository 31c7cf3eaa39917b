"""Supervised fine-tuning data: OpenAI-style chats (JSONL) to packed, canvas-aligned training rows and their masks.
The loss is `train/diffusion.py:sft_loss`; `train/loop.py:train` runs it with `objective="sft"`.

Input: one JSON object per line, `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
(content may also be a list of `{"type": "text", "text": ...}` parts). Every assistant message is one example: its
prompt is everything before it, rendered with the checkpoint's chat template and the generation prompt (the text a
chat request commits), and its response is the assistant turn as the template renders it, up to and including the
template's end-of-turn token (`<turn|>` for Gemma):

    prompt   = template(messages[:i], add_generation_prompt=True)     "<bos><|turn>user\\nQ<turn|>\\n<|turn>model\\n"
    response = template(messages[:i+1])[len(prompt):].rstrip()        "A<turn|>"

At sampling time the prompt is committed and canvases of L tokens start right after it, so the response is cut into
canvases from its first token: canvas k holds response tokens [kL, (k+1)L), its last canvas padded with the pad id.
One example in a training row (P prompt tokens, R response tokens, n = ceil(R / L) canvases):

    clean stream   [ prompt (P) | response canvases 0 .. n-2 (clean) ]    encoder role, causal: what commit writes
    noisy stream   [ canvas 0 | canvas 1 | ... | canvas n-1 ]             decoder role; train/diffusion.py noises each

Noisy canvas k attends to the clean tokens at positions < P + kL (its sliding layers to the last sliding_window - 1
of them) and to itself, bidirectionally: exactly commit(prompt + canvases < k) then denoise(canvas k). Positions
are the ones sampling uses (canvas k at P + kL ...). The loss covers the response tokens only (`loss_mask`): not the
prompt, not the pad tail of the last canvas. The last canvas's clean copy would be seen by no one, so it is not in
the clean stream.

Packing: a row has `seq_len` clean slots and `seq_len` noisy slots; examples are packed into rows greedily (in a
seeded order per epoch) while both streams have room. Each example has its own segment id and positions from 0, and
attends only within itself; unused slots are padding (segment -1), which attends only to itself and is in no loss.
Batch m of the stream is a function of the seed and m alone, so resume stays bit-exact.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dgemma.data.shards import DataError, parse_json_row
from dgemma.data.templates import ChatTemplate, ChatTemplateError
from dgemma.data.tokenizer import Tokenizer, encode_template
from dgemma.model.attention import FULL, SLIDING
from dgemma.weights.checkpoint import MODEL_FILES

ASSISTANT_ROLES = ("assistant", "model")



class ChatDataError(DataError):
    """A chat file that cannot be used; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Example:
    """One assistant turn to learn: `prompt` ids (clean context) and `response` ids (ends with the end-of-turn id)."""

    prompt: list[int]
    response: list[int]
    source: str  # "FILE line N, messages[i]"

    def canvases(self, L: int) -> int:
        return -(-len(self.response) // L)

    def clean_length(self, L: int) -> int:
        return len(self.prompt) + (self.canvases(L) - 1) * L


def read_chats(path: str | os.PathLike[str]) -> list[tuple[int, list[dict[str, Any]]]]:
    """(line number, messages) of every non-empty line of a JSONL file; any malformed line raises ChatDataError
    naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such chat file (JSONL, one {{\"messages\": [...]}} per line)")
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path} line {n}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ChatDataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            obj = parse_json_row(text, where, ChatDataError)
            if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
                raise ChatDataError(f"{where}: field 'messages' must be a non-empty list of messages")
            out.append((n, [_message(m, f"{where}: messages[{i}]") for i, m in enumerate(obj["messages"])]))
    if not out:
        raise ChatDataError(f"{path}: no conversations (the file is empty)")
    return out


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise ChatDataError(f"{where}: must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ChatDataError(f"{where}: field 'role' is missing or not a string")
    if "content" not in m and not m.get("tool_calls"):
        raise ChatDataError(f"{where}: field 'content' is missing")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ChatDataError(f"{where}: field 'content': only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                "are supported")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ChatDataError(f"{where}: field 'content' must be a string, got {type(content).__name__}")
    return {**m, "content": content}


def build_examples(path: str | os.PathLike[str], tokenizer: Tokenizer, template: ChatTemplate
                   ) -> tuple[list[Example], int]:
    """Every assistant turn of the chat file as an Example, and the end-of-turn id every response ends with."""
    examples: list[Example] = []
    end_ids: dict[int, str] = {}
    for n, messages in read_chats(path):
        turns = [i for i, m in enumerate(messages) if m["role"] in ASSISTANT_ROLES]
        if not turns:
            raise ChatDataError(f"{path} line {n}: field 'messages' has no assistant message to learn from")
        for i in turns:
            where = f"{path} line {n}, messages[{i}]"
            try:
                prompt = template.render(messages[:i], add_generation_prompt=True)
                full = template.render(messages[:i + 1], add_generation_prompt=False)
            except ChatTemplateError as e:
                raise ChatDataError(f"{where}: {e}") from None
            if not full.startswith(prompt):
                raise ChatDataError(f"{where}: the chat template ({template.origin}) does not render the conversation "
                                    "with this answer as the prompt followed by the answer, so the answer cannot be "
                                    "cut from it")
            response = encode_template(tokenizer, full[len(prompt):].rstrip())
            if len(response) < 2:
                raise ChatDataError(f"{where}: the template renders this answer as {full[len(prompt):]!r}: no text "
                                    "and end-of-turn token to learn")
            end_ids.setdefault(response[-1], where)
            examples.append(Example(encode_template(tokenizer, prompt), response, where))
    if len(end_ids) > 1:
        found = "; ".join(f"{tokenizer.decode([i])!r} ({w})" for i, w in end_ids.items())
        raise ChatDataError(f"{path}: the answers end with different tokens ({found}); the chat template must close "
                            "every assistant turn with the same end-of-turn token")
    return examples, next(iter(end_ids))


def check_fits(examples: list[Example], L: int, seq_len: int, max_positions: int) -> None:
    """Every example must fit one row: its clean context in `seq_len` slots, its canvases in `seq_len` slots."""
    for ex in examples:
        n = ex.canvases(L)
        if ex.clean_length(L) > seq_len or n * L > seq_len or len(ex.prompt) + n * L > max_positions:
            raise ChatDataError(f"{ex.source}: conversation longer than the context: a prompt of {len(ex.prompt)} "
                                f"tokens and an answer of {len(ex.response)} ({n} canvas(es) of {L}) need "
                                f"{ex.clean_length(L)} clean and {n * L} canvas slots, but --seq-len is {seq_len}"
                                + (f" (and the model has {max_positions} positions)"
                                   if len(ex.prompt) + n * L > max_positions else "")
                                + "; raise --seq-len or shorten the conversation")


def pack(examples: list[Example], order: list[int], L: int, seq_len: int) -> list[list[int]]:
    """Rows of example indices, greedily in `order`: a row takes examples while its clean and noisy streams have
    room (`seq_len` slots each), else a new row starts."""
    rows: list[list[int]] = []
    clean = noisy = seq_len + 1  # forces a first row
    for i in order:
        c, m = examples[i].clean_length(L), examples[i].canvases(L) * L
        if clean + c > seq_len or noisy + m > seq_len:
            rows.append([])
            clean = noisy = 0
        rows[-1].append(i)
        clean, noisy = clean + c, noisy + m
    return rows


@dataclass
class ChatBatch:
    """Packed rows (B rows): the clean stream (B, C) and the noisy stream's clean targets (B, N), N a multiple of L,
    with each token's position, segment (example within its row; -1: padding) and, for canvas tokens, the clean
    position where their canvas starts. `loss_mask` (B, N): the response tokens."""

    clean: Tensor
    clean_pos: Tensor
    clean_seg: Tensor
    x0: Tensor
    noisy_pos: Tensor
    noisy_seg: Tensor
    canvas_start: Tensor
    loss_mask: Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ChatBatch:
        return ChatBatch(*(getattr(self, f).to(device, non_blocking=non_blocking) for f in self.__dataclass_fields__))

    def __getitem__(self, rows: slice) -> ChatBatch:
        """Some of the rows (a rank's share of a global batch)."""
        return ChatBatch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @property
    def shape(self) -> torch.Size:
        """(rows, canvas slots): the trainer reads the batch size from it, as from a window batch."""
        return self.x0.shape

    @property
    def positions(self) -> Tensor:
        return torch.cat([self.clean_pos, self.noisy_pos], 1)

    @property
    def tokens(self) -> int:
        """Target tokens in the loss."""
        return int(self.loss_mask.sum())


def collate(examples: list[Example], rows: list[list[int]], L: int, seq_len: int, pad_id: int) -> ChatBatch:
    """The ChatBatch of packed `rows` (lists of example indices)."""
    B = len(rows)
    a = {k: np.zeros((B, seq_len), np.int64) for k in ("clean", "clean_pos", "x0", "noisy_pos", "canvas_start")}
    a["clean"][:], a["x0"][:] = pad_id, pad_id
    a["clean_seg"], a["noisy_seg"] = np.full((B, seq_len), -1, np.int64), np.full((B, seq_len), -1, np.int64)
    a["loss_mask"] = np.zeros((B, seq_len), bool)
    for r, row in enumerate(rows):
        c = m = 0
        for s, i in enumerate(row):
            ex = examples[i]
            P, R, n = len(ex.prompt), len(ex.response), ex.canvases(L)
            clean = ex.prompt + ex.response[:(n - 1) * L]
            a["clean"][r, c:c + len(clean)] = clean
            a["clean_pos"][r, c:c + len(clean)] = np.arange(len(clean))
            a["clean_seg"][r, c:c + len(clean)] = s
            a["x0"][r, m:m + R] = ex.response
            a["noisy_pos"][r, m:m + n * L] = P + np.arange(n * L)
            a["noisy_seg"][r, m:m + n * L] = s
            a["canvas_start"][r, m:m + n * L] = P + np.arange(n * L) // L * L
            a["loss_mask"][r, m:m + R] = True
            c, m = c + len(clean), m + n * L
    return ChatBatch(**{k: torch.from_numpy(v) for k, v in a.items()})


def sft_masks(batch: ChatBatch, canvas_length: int, window: int) -> dict[str, Tensor]:
    """Masks (B, 1, C + N, C + N) over [clean ; noisy] per layer type (True = may attend): clean tokens attend
    causally within their example (sliding layers: `window` keys including self); a canvas token attends to its
    example's clean tokens before its canvas (sliding: the last `window - 1`) and to its own canvas; padding attends
    only to itself."""
    C = batch.clean.shape[1]
    seg = torch.cat([batch.clean_seg, batch.noisy_seg], 1)
    pos = batch.positions
    S = seg.shape[1]
    noisy = (torch.arange(S, device=seg.device) >= C)[None]
    start = torch.cat([torch.zeros_like(batch.clean_pos), batch.canvas_start], 1)
    canvas = torch.cat([torch.full_like(batch.clean_pos, -1),
                        (torch.arange(batch.x0.shape[1], device=seg.device) // canvas_length).expand_as(batch.x0)], 1)
    sq, sk = seg[:, :, None], seg[:, None, :]
    pq, pk = pos[:, :, None], pos[:, None, :]
    nq, nk = noisy[:, :, None], noisy[:, None, :]
    same = (sq == sk) & (sq >= 0)
    causal = same & ~nq & ~nk & (pk <= pq)
    prefix = same & nq & ~nk & (pk < start[:, :, None])
    own = same & nq & nk & (canvas[:, :, None] == canvas[:, None, :])
    pad = (seg < 0)[:, :, None] & torch.eye(S, dtype=torch.bool, device=seg.device)[None]
    full = causal | prefix | own | pad
    sliding = (causal & (pq - pk < window)) | (prefix & (pk >= start[:, :, None] - (window - 1))) | own | pad
    return {FULL: full[:, None], SLIDING: sliding[:, None]}


class ChatData:
    """A chat file as training batches: `batches` (the seeded packed order, epoch after epoch, restartable at any
    batch) and `heldout_batches` (the file's order, for the held-out loss), with the interface of
    `data/shards.py:TokenDataset` that the trainer uses."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: Tokenizer, template: ChatTemplate, *,
                 canvas_length: int, seq_len: int, max_positions: int, pad_id: int, model_dir: Path | None = None):
        self.path, self.L, self.seq_len, self.pad_id = Path(path), canvas_length, seq_len, pad_id
        self.examples, self.end_id = build_examples(path, tokenizer, template)
        self.eot_id = self.end_id  # where generation must stop (the trainer adds it to the EOS ids)
        self.model_files = [Path(model_dir) / f for f in MODEL_FILES] if model_dir is not None else []
        check_fits(self.examples, canvas_length, seq_len, max_positions)
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self._epochs: dict[int, list[list[int]]] = {}

    def epoch_rows(self, seed: int, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
            order = torch.randperm(len(self.examples), generator=g).tolist()
            self._epochs = {epoch: pack(self.examples, order, self.L, self.seq_len)}
        return self._epochs[epoch]

    def batches(self, batch_size: int, seq_len: int, seed: int, start_batch: int = 0, shift: int = 0,
                rank: int = 0, world_size: int = 1) -> Iterator[ChatBatch]:
        """Endless batches of `batch_size` packed rows; batch m is rows [m B, (m + 1) B) of the row stream that
        concatenates the epochs (each packed in its own seeded order). With `world_size` W, batch m is the global
        batch of W B rows and this `rank` gets rows [rank B, (rank + 1) B) of it."""
        assert seq_len == self.seq_len and shift == 0
        for batch in self._global_batches(batch_size * world_size, seed, start_batch):
            yield batch[rank * batch_size:(rank + 1) * batch_size]

    def _global_batches(self, batch_size: int, seed: int, start_batch: int) -> Iterator[ChatBatch]:
        row, epoch = start_batch * batch_size, 0
        while row >= len(self.epoch_rows(seed, epoch)):
            row -= len(self.epoch_rows(seed, epoch))
            epoch += 1
        while True:
            rows: list[list[int]] = []
            while len(rows) < batch_size:
                epoch_rows = self.epoch_rows(seed, epoch)
                take = epoch_rows[row:row + batch_size - len(rows)]
                rows += take
                row += len(take)
                if row == len(epoch_rows):
                    row, epoch = 0, epoch + 1
            yield collate(self.examples, rows, self.L, self.seq_len, self.pad_id)

    def heldout_batches(self, batch_size: int, seq_len: int, shift: int = 0) -> Iterator[ChatBatch]:
        """Batches of the examples packed in file order (the last one may be smaller), once."""
        rows = pack(self.examples, list(range(len(self.examples))), self.L, self.seq_len)
        for lo in range(0, len(rows), batch_size):
            yield collate(self.examples, rows[lo:lo + batch_size], self.L, self.seq_len, self.pad_id)

    def fingerprint(self, tokenizer_sha256: str) -> dict[str, Any]:
        """run.json's record of the data, in `run_dir.data_fingerprint`'s shape (the chat file as the one shard)."""
        return {"tokenizer_sha256": tokenizer_sha256, "shards": {self.path.name: self.sha256}}
