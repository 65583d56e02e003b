"""The core of kvbridge: cache-group semantics, transfer planning and the transport contract.

Nothing here imports torch, a serving engine or a transfer engine.
"""

from kvbridge.core.batches import Fence, TransferHandle, TransferOp, TransferState, TransferStatus
from kvbridge.core.block_mapping import (
    align_block_ids,
    clip_sliding_window,
    drop_null_blocks,
    logical_to_kernel,
    pair_block_ids,
    prepare_block_ids,
)
from kvbridge.core.boundary import (
    blocks_for_tokens,
    prefill_token_count,
    remote_prefill_token_count,
)
from kvbridge.core.compat import check_compatible, layout_differences
from kvbridge.core.contract import MemoryAccess, TransportContract, TransportLimits
from kvbridge.core.errors import (
    BlockIdError,
    KvbridgeError,
    LayoutError,
    LayoutMismatchError,
    PeerError,
    PlanError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportConflictError,
    TransportError,
    TransportNotFoundError,
    TransportOptionError,
    TransportUnavailableError,
)
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, Layout, LayoutSpec, Part, Region
from kvbridge.core.memory import MemoryKind, MemoryRange
from kvbridge.core.planning import TransferPlan, merge_descriptors, plan_transfers
from kvbridge.core.registry import register_transport, unregister_transport
from kvbridge.core.transport import Transport

__all__ = [
    "BlockIdError",
    "CacheGroup",
    "CacheTensor",
    "GroupKind",
    "KVLayout",
    "KvbridgeError",
    "Layout",
    "LayoutError",
    "LayoutMismatchError",
    "LayoutSpec",
    "Fence",
    "MemoryAccess",
    "MemoryKind",
    "MemoryRange",
    "Part",
    "PeerError",
    "PlanError",
    "Region",
    "RegistrationError",
    "TransferError",
    "TransferHandle",
    "TransferOp",
    "TransferPlan",
    "TransferState",
    "TransferStatus",
    "TransferTimeoutError",
    "Transport",
    "TransportConflictError",
    "TransportContract",
    "TransportError",
    "TransportLimits",
    "TransportNotFoundError",
    "TransportOptionError",
    "TransportUnavailableError",
    "align_block_ids",
    "pair_block_ids",
    "blocks_for_tokens",
    "check_compatible",
    "clip_sliding_window",
    "drop_null_blocks",
    "layout_differences",
    "logical_to_kernel",
    "merge_descriptors",
    "plan_transfers",
    "prefill_token_count",
    "prepare_block_ids",
    "register_transport",
    "remote_prefill_token_count",
    "unregister_transport",
]
