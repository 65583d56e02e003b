"""A slow, block-by-block, token-by-token reference of what a transfer must copy.

Written from the definitions in DESIGN.md and from the ``CacheTensor`` fields directly, without
the core's region expansion, block mapping or planner, so the two can check each other.
"""

from __future__ import annotations

import math

import numpy as np

from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, Layout


class Refused(Exception):
    """The request's block lists must be refused: moving them would put bytes in wrong places."""


def _kept_ids(group: CacheGroup, ids: list[int]) -> list[int]:
    if group.kind is GroupKind.STATE:
        return [i for i in ids if i != group.null_block_id]
    if group.kind is GroupKind.SLIDING_WINDOW:
        keep = math.ceil((group.sliding_window or 0) / group.block_size) + 1
        return ids[-keep:]
    return list(ids)


def paired_ids(
    sg: CacheGroup, dg: CacheGroup, s_ids: list[int], d_ids: list[int]
) -> list[tuple[int, int]]:
    """(source id, destination id) pairs, or ``Refused`` when the lists cannot mean the same.

    Block lists are both sides' tails of one token sequence: position ``-1`` is the last block
    on both. The source must cover every position the destination asks for (checked on the
    lists as given, before a sliding window drops old blocks), and a state slot is a whole
    state, so STATE groups must name as many real slots on both sides.
    """
    if sg.kind is GroupKind.STATE:
        s, d = _kept_ids(sg, s_ids), _kept_ids(dg, d_ids)
        if len(s) != len(d):
            raise Refused(f"state slots {len(s)} vs {len(d)}")
        return list(zip(s, d, strict=True))
    if len(s_ids) < len(d_ids):
        raise Refused(f"source holds {len(s_ids)} blocks, destination asks {len(d_ids)}")
    s, d = _kept_ids(sg, s_ids), _kept_ids(dg, d_ids)
    return list(zip(s[len(s) - len(d) :], d, strict=True))


def paired_tokens(
    sg: CacheGroup, dg: CacheGroup, s_ids: list[int], d_ids: list[int], first: int | None
) -> list[tuple[int, int, int, int]]:
    """Between different block sizes: ``(source block, its token, destination block, its
    token)`` per token both lists hold, or ``Refused``.

    The source list holds the request's tokens from 0, the destination's from ``first`` (a
    multiple of its block size); the source must reach into the destination's last block.
    """
    bs, bd = sg.block_size, dg.block_size
    if sg.kind is GroupKind.SLIDING_WINDOW or first is None or first % bd:
        raise Refused(f"block sizes {bs} vs {bd}, first token {first}")
    if d_ids and len(s_ids) * bs <= first + (len(d_ids) - 1) * bd:
        raise Refused(f"source tokens {len(s_ids) * bs}, destination from {first}")
    out = []
    for t in range(first, min(len(s_ids) * bs, first + len(d_ids) * bd)):
        out.append((s_ids[t // bs], t % bs, d_ids[(t - first) // bd], (t - first) % bd))
    return out


def _parts(tensor: CacheTensor, group: CacheGroup) -> list[str]:
    if group.kind in (GroupKind.ATTENTION, GroupKind.SLIDING_WINDOW):
        return ["WHOLE"] if tensor.kv_layout is KVLayout.WHOLE else ["K", "V"]
    return ["WHOLE"]


def _token_addr(tensor: CacheTensor, group: CacheGroup, part: str, block: int, token: int) -> int:
    ratio = group.block_size // group.kernel_size
    kernel_stride = tensor.block_stride // ratio
    bytes_per_token = tensor.block_bytes // group.block_size
    kernel = block * ratio + token // group.kernel_size
    within = (token % group.kernel_size) * bytes_per_token
    if part == "V":
        if tensor.kv_layout is KVLayout.K_FIRST:
            assert tensor.v_addr is not None
            return tensor.v_addr + kernel * kernel_stride + within
        v_offset = tensor.v_offset if tensor.v_offset is not None else tensor.block_bytes
        return tensor.addr + kernel * kernel_stride + v_offset // ratio + within
    return tensor.addr + kernel * kernel_stride + within


def reference_descriptors(
    src: Layout,
    dst: Layout,
    src_ids: dict[int, list[int]],
    dst_ids: dict[int, list[int]],
    layer: str | None = None,
    dst_first_token: int | None = None,
) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` per token (per slot for STATE) of everything that must move
    (of that one layer's tensors when ``layer`` is given).

    Raises ``Refused`` when the block lists must be refused.
    """
    out: list[tuple[int, int, int]] = []
    src_tensors = {(t.layer_name, t.tensor): t for t in src.spec.tensors}
    for index in dst_ids:
        sg, dg = src.groups[index], dst.groups[index]
        if sg.kind.paged and sg.block_size != dg.block_size:
            tokens = paired_tokens(
                sg, dg, list(src_ids[index]), list(dst_ids[index]), dst_first_token
            )
            for dt in dst.spec.tensors:
                if dt.group_index != index or (layer is not None and dt.layer_name != layer):
                    continue
                st = src_tensors[(dt.layer_name, dt.tensor)]
                n = dt.block_bytes // dg.block_size
                for part in _parts(dt, dg):
                    for sb, s_tok, db, d_tok in tokens:
                        s_addr = _token_addr(st, sg, part, sb, s_tok)
                        out.append((s_addr, _token_addr(dt, dg, part, db, d_tok), n))
            continue
        pairs = paired_ids(sg, dg, list(src_ids[index]), list(dst_ids[index]))
        s_blocks, d_blocks = [p for p, _ in pairs], [d for _, d in pairs]
        for dt in dst.spec.tensors:
            if dt.group_index != index or (layer is not None and dt.layer_name != layer):
                continue
            st = src_tensors[(dt.layer_name, dt.tensor)]
            for part in _parts(dt, dg):
                for sb, db in zip(s_blocks, d_blocks, strict=True):
                    if dg.kind is GroupKind.STATE:
                        s_addr = st.addr + sb * st.block_stride
                        d_addr = dt.addr + db * dt.block_stride
                        out.append((s_addr, d_addr, dt.block_bytes))
                        continue
                    n = dt.block_bytes // dg.block_size
                    for token in range(dg.block_size):
                        s_addr = _token_addr(st, sg, part, sb, token)
                        d_addr = _token_addr(dt, dg, part, db, token)
                        out.append((s_addr, d_addr, n))
    return out


def reference_copy(
    descriptors: list[tuple[int, int, int]], src_memory: np.ndarray, dst_memory: np.ndarray
) -> None:
    for s_addr, d_addr, n in descriptors:
        dst_memory[d_addr : d_addr + n] = src_memory[s_addr : s_addr + n]


def minimum_descriptor_count(descriptors: list[tuple[int, int, int]]) -> int:
    """Maximal runs adjacent on both sides: descriptors that no other descriptor continues into."""
    ends = {(s + n, d + n) for s, d, n in descriptors}
    return sum((s, d) not in ends for s, d, _ in descriptors)
