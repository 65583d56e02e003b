"""vLLM's TP sharding of the caches of common model kinds, as ``Shard``s.

Which slice of the model's cache each TP rank holds is vLLM's decision (``QKVParallelLinear``,
MLA's replicated latent, GDN's sub-projections); the core's TP mapping (``kvbridge.core.tp``)
only reads the shards. Importing this module does not import vLLM or torch.
"""

from __future__ import annotations

from kvbridge.core.errors import LayoutError
from kvbridge.core.layout import Shard


def attention_shards(
    num_kv_heads: int,
    tp_rank: int,
    tp_size: int,
    head_bytes: int,
    *,
    offset: int = 0,
    axis: str = "kv_heads",
    token_major: bool = False,
    head_stride: int = 0,
) -> list[Shard]:
    """KV heads of a head-major attention tensor (``head_bytes``: one head's bytes of a logical
    block of one part). As vLLM's ``QKVParallelLinear``: with ``K >= T`` heads rank ``r``
    holds heads ``[r*K/T, (r+1)*K/T)``; else head ``r // (T/K)``, replicated on ``T/K`` ranks.
    For a tensor moved whole (K and V in one part) give K and V each its own axis and offset.
    ``head_stride``: bytes from one head to the next when heads are padded (0: packed).
    ``token_major``: each head's slice of a kernel block lists its tokens in order (``[N, C]``
    cells), so slices may move between different kernel block sizes.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not divide over {tp_size} TP ranks")
        per = num_kv_heads // tp_size
        return [
            Shard(
                axis, tp_rank * per, per, head_bytes, offset, head_stride, token_major=token_major
            )
        ]
    if tp_size % num_kv_heads:
        raise LayoutError(f"{tp_size} TP ranks do not replicate {num_kv_heads} KV heads evenly")
    replicas = tp_size // num_kv_heads
    return [
        Shard(
            axis,
            tp_rank // replicas,
            1,
            head_bytes,
            offset,
            head_stride,
            replicas=replicas,
            replica=tp_rank % replicas,
            token_major=token_major,
        )
    ]


def mla_shards(block_bytes: int, tp_rank: int, tp_size: int) -> list[Shard]:
    """MLA's latent cache: the same on every rank, read from one source rank."""
    return [Shard("latent", 0, 1, block_bytes, replicas=tp_size, replica=tp_rank)]


def gdn_conv_shards(
    key_dim: int,
    value_dim: int,
    state_len: int,
    dtype_bytes: int,
    tp_rank: int,
    tp_size: int,
    conv_layout: str = "SD",
    offset: int = 0,
) -> list[Shard]:
    """A GDN conv state: each rank holds channels ``[q | k | v]`` of its slice of each
    sub-projection (``key_dim`` channels for q and k, ``value_dim`` for v, sharded evenly).

    ``conv_layout`` as vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``: ``"SD"`` (default,
    ``[state_len, dim]``: every row holds a slice of each sub-projection) or ``"DS"``
    (``[dim, state_len]``: a channel is ``state_len`` values in a row).
    """
    if key_dim % tp_size or value_dim % tp_size:
        raise LayoutError(f"conv dims {key_dim}/{value_dim} do not divide over {tp_size} ranks")
    q, v = key_dim // tp_size, value_dim // tp_size
    dim = 2 * q + v
    if conv_layout == "SD":
        unit, rows, row_stride = dtype_bytes, state_len, dim * dtype_bytes
    elif conv_layout == "DS":
        unit, rows, row_stride = state_len * dtype_bytes, 1, 0
    else:
        raise LayoutError(f"conv state layout {conv_layout!r} is neither 'SD' nor 'DS'")
    return [
        Shard(axis, tp_rank * n, n, unit, offset + at * unit, rows=rows, row_stride=row_stride)
        for axis, n, at in (("conv_q", q, 0), ("conv_k", q, q), ("conv_v", v, 2 * q))
    ]


def gdn_ssm_shards(
    num_v_heads: int, tp_rank: int, tp_size: int, head_bytes: int, offset: int = 0
) -> list[Shard]:
    """A GDN ssm state ``[heads, head_v_dim, head_k_dim]``: rank ``r`` holds its heads."""
    if num_v_heads % tp_size:
        raise LayoutError(f"{num_v_heads} ssm heads do not divide over {tp_size} TP ranks")
    n = num_v_heads // tp_size
    return [Shard("ssm_heads", tp_rank * n, n, head_bytes, offset)]
