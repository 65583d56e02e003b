"""Cache groups: sets of layers that share one block table."""

from __future__ import annotations

import enum

import msgspec


class GroupKind(str, enum.Enum):
    """How a group's blocks hold the cache, which decides how its regions move."""

    ATTENTION = "ATTENTION"  # paged K/V per token
    SLIDING_WINDOW = "SLIDING_WINDOW"  # attention whose blocks older than the window are dropped
    MLA = "MLA"  # one latent vector per token, no K/V split
    STATE = "STATE"  # GDN/Mamba recurrent state: a block id names a state slot, not a token page

    @property
    def paged(self) -> bool:
        """Paged groups index tokens, so logical blocks expand into kernel blocks."""
        return self is not GroupKind.STATE


class CacheGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cache group of a worker.

    ``block_size`` is the logical block size in tokens (what the scheduler's block table uses);
    ``kernel_block_size`` is the block size the attention kernel addresses, a divisor of it.
    ``num_blocks`` is the number of logical blocks (state slots for ``STATE``) in the pool.
    ``null_block_id`` is the id a ``STATE`` group uses as a placeholder for slots it does not hold.
    """

    index: int
    kind: GroupKind
    block_size: int
    num_blocks: int
    kernel_block_size: int | None = None
    sliding_window: int | None = None
    null_block_id: int = 0

    @property
    def kernel_size(self) -> int:
        """Kernel block size in tokens (the logical size when no kernel size is given)."""
        return self.kernel_block_size or self.block_size

    @property
    def ratio(self) -> int:
        """Kernel blocks per logical block; always 1 for ``STATE`` groups."""
        return self.block_size // self.kernel_size if self.kind.paged else 1

    def validate(self) -> list[str]:
        """Problems with this group on its own (empty when it is consistent)."""
        problems = []
        where = f"group {self.index} ({self.kind.value})"
        if self.block_size <= 0:
            problems.append(f"{where}: block_size must be positive, got {self.block_size}")
        elif self.kind.paged and (self.kernel_size <= 0 or self.block_size % self.kernel_size != 0):
            problems.append(
                f"{where}: kernel_block_size {self.kernel_block_size} must divide "
                f"block_size {self.block_size}"
            )
        if self.num_blocks <= 0:
            problems.append(f"{where}: num_blocks must be positive, got {self.num_blocks}")
        if self.kind is GroupKind.SLIDING_WINDOW and not (self.sliding_window or 0) > 0:
            problems.append(f"{where}: a SLIDING_WINDOW group needs a positive sliding_window")
        return problems
