"""Third-party messages that alarm users and mean nothing for dgemma, each silenced by its exact text in the one
place it is emitted (never a blanket "ignore"): what else those libraries say still shows.

- torchao, imported by peft and transformers (LoRA, `dgemma finetune`) and by `--quantize`, logs "Failed to load
  .../_C_*.so" for each optional CUDA extension a CPU build of torch cannot load, and torch's pytree logs that the
  enums torchao registers no longer need registering. Neither concerns what dgemma uses (weight-only int8/int4, peft's
  LoRA layers): `optional_imports()` drops those two records while the import runs.
(DDP's find_unused_parameters notice is not here: torch's C++ reducer prints it past Python's warning filters.)
- FSDP2 warns that a wrapped module "returned a view tensor" on which an in-place op "will silently drop the
  pre-backward hook": dgemma modifies no output of a wrapped module (a block, the loss module) in place, so the
  hazard it names cannot happen.
  `fsdp_view_outputs()` drops that warning.

One module for these filters, beside the other process-wide plumbing, because weights/ (torchao, peft) and train/
(FSDP2) both need them and each filter should be written, and justified, once.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

TORCHAO_SO = re.compile(r"Failed to load \S*torchao\S*/_C\w*\.\S*so\b")
PYTREE_ENUM = re.compile(r"is an Enum subclass and is now natively supported by torch\.compile")
FSDP_VIEW = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def optional_imports() -> Iterator[None]:
    """Import peft, transformers or torchao inside this block: torchao's "Failed to load ..._C*.so" and torch's
    pytree "Enum subclass" records are dropped (both loggers keep every other record)."""
    filters = [(logging.getLogger("torchao"), _Drop(TORCHAO_SO)),
               (logging.getLogger("torch.utils._pytree"), _Drop(PYTREE_ENUM))]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def fsdp_view_outputs() -> None:
    """For a process that trains under FSDP2: the "returned a view tensor" warning (raised in forward passes, so for
    the rest of the process) is ignored, by its exact text."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW, category=UserWarning)
