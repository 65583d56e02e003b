"""A slow reference of what each prefill (P) TP rank must send one decode (D) TP rank.

Written from the model's definition (global KV heads, latent, GDN conv channels per
sub-projection and ssm heads; vLLM's TP sharding) and the physical layouts the tests build
(``TPModel``), not from ``Shard`` fields or the core's restriction: for every head/channel and
every token (or state row) of every block D needs, which P rank it comes from and where it lies
on both sides. Units held by several P ranks (replicated KV heads, MLA) come from the one holder among the P
ranks D rank ``d`` talks to (the lowest of them): ``d // (D/P)`` when D's TP size ``D`` is at
least P's ``P``, else ``[d*P/D, (d+1)*P/D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, Layout

from .reference import paired_ids

Descriptor = tuple[int, int, int]


@dataclass(frozen=True)
class TPModel:
    """A model's cache shape and the physical layout every rank of the tests uses.

    Attention blocks are head-major: a kernel block's part (K or V) is ``[heads, tokens,
    head_bytes]``. MLA blocks are ``[tokens, latent_bytes]`` on every rank. A GDN layer's state
    slot holds the conv state (2-byte channels ``[q | k | v]`` of the rank's slices; ``SD``:
    ``[state_len, dim]``, ``DS``: ``[dim, state_len]``) then the ssm state ``[heads,
    ssm_head_bytes]``.
    """

    kind: str  # "attention", "swa", "mla", "gdn"
    kv_heads: int = 2
    head_bytes: int = 2
    block: int = 4
    layers: int = 2
    window: int = 5
    latent_bytes: int = 3
    key_dim: int = 8
    value_dim: int = 16
    state_len: int = 2
    conv_layout: str = "SD"
    v_heads: int = 8
    ssm_head_bytes: int = 3
    kv_layout: KVLayout = KVLayout.BLOCKS_FIRST
    pad: int = 0
    #: whether the layouts' attention shards say that a head's slice lists its tokens in order
    #: (true of the head-major blocks built here); false refuses different kernel block sizes
    units_token_major: bool = True
    #: bytes after each head's slice of a kernel block (heads ``unit_stride`` apart)
    head_pad: int = 0


CHANNEL = 2  # bytes of one conv channel value


def heads_of(model: TPModel, rank: int, tp: int) -> list[int]:
    """Global KV heads a rank holds (vLLM: a contiguous slice, or one replicated head)."""
    k = model.kv_heads
    if k >= tp:
        return list(range(rank * k // tp, (rank + 1) * k // tp))
    return [rank // (tp // k)]


def kv_replicas(model: TPModel, tp: int) -> int:
    return max(1, tp // model.kv_heads)


def local_heads(model: TPModel, tp: int) -> int:
    return max(1, model.kv_heads // tp)


def attention_addr(
    model: TPModel, t: CacheTensor, tp: int, kernel: int, part: str, block: int, head: int, tok: int
) -> int:
    """Address of token ``tok``'s ``head_bytes`` of local head ``head`` in logical ``block``."""
    ratio = model.block // kernel
    kstride = t.block_stride // ratio
    per_head = kernel * model.head_bytes + model.head_pad
    base = t.addr
    if part == "V":
        if model.kv_layout is KVLayout.K_FIRST:
            assert t.v_addr is not None
            base = t.v_addr
        else:
            base = t.addr + local_heads(model, tp) * per_head
    kb = block * ratio + tok // kernel
    return base + kb * kstride + head * per_head + (tok % kernel) * model.head_bytes


def conv_channels(model: TPModel, tp: int) -> dict[str, tuple[int, int]]:
    """Per sub-projection: (channels per rank, first local channel index)."""
    q, v = model.key_dim // tp, model.value_dim // tp
    return {"q": (q, 0), "k": (q, q), "v": (v, 2 * q)}


def conv_offset(model: TPModel, tp: int, sub: str, local: int, row: int) -> int:
    q, v = model.key_dim // tp, model.value_dim // tp
    dim = 2 * q + v
    channel = conv_channels(model, tp)[sub][1] + local
    if model.conv_layout == "SD":
        return (row * dim + channel) * CHANNEL
    return (channel * model.state_len + row) * CHANNEL


def conv_bytes(model: TPModel, tp: int) -> int:
    return (2 * model.key_dim + model.value_dim) // tp * model.state_len * CHANNEL


def _tensors(layout: Layout) -> dict[tuple[str, str], CacheTensor]:
    return {(t.layer_name, t.tensor): t for t in layout.spec.tensors}


def _contacts(rank: int, tp_d: int, tp_p: int) -> range:
    if tp_d >= tp_p:
        return range(rank // (tp_d // tp_p), rank // (tp_d // tp_p) + 1)
    return range(rank * (tp_p // tp_d), (rank + 1) * (tp_p // tp_d))


def _pick(holders: list[int], rank: int, tp_d: int, tp_p: int) -> int:
    return min(p for p in holders if p in _contacts(rank, tp_d, tp_p))


def reference_tp(
    model: TPModel,
    p_layouts: list[Layout],
    d_layout: Layout,
    p_ids: dict[int, list[int]],
    d_ids: dict[int, list[int]],
) -> dict[int, list[Descriptor]]:
    """``(p_addr, d_addr, length)`` per P rank, per head-token / channel-row / ssm head."""
    tp_p, tp_d, rank = len(p_layouts), d_layout.spec.tp_size, d_layout.spec.tp_rank
    out: dict[int, list[Descriptor]] = {}
    p_tensors = [_tensors(p) for p in p_layouts]
    for index in d_ids:
        dg = d_layout.groups[index]
        sg = p_layouts[0].groups[index]
        pairs = paired_ids(sg, dg, list(p_ids[index]), list(d_ids[index]))
        for dt in d_layout.spec.tensors:
            if dt.group_index != index:
                continue
            key = (dt.layer_name, dt.tensor)
            if dg.kind is GroupKind.MLA:
                q = _pick(list(range(tp_p)), rank, tp_d, tp_p)  # every P rank holds it
                st = p_tensors[q][key]
                kp, kd = sg.kernel_size, dg.kernel_size
                for sb, db in pairs:
                    for tok in range(model.block):
                        s = (
                            st.addr
                            + (sb * (model.block // kp) + tok // kp)
                            * (st.block_stride // (model.block // kp))
                            + (tok % kp) * model.latent_bytes
                        )
                        d = (
                            dt.addr
                            + (db * (model.block // kd) + tok // kd)
                            * (dt.block_stride // (model.block // kd))
                            + (tok % kd) * model.latent_bytes
                        )
                        out.setdefault(q, []).append((s, d, model.latent_bytes))
            elif dg.kind.paged:
                d_heads = heads_of(model, rank, tp_d)
                for hd, g in enumerate(d_heads):
                    holders = [p for p in range(tp_p) if g in heads_of(model, p, tp_p)]
                    q = _pick(holders, rank, tp_d, tp_p)
                    hp = heads_of(model, q, tp_p).index(g)
                    st = p_tensors[q][key]
                    for part in ("K", "V"):
                        for sb, db in pairs:
                            for tok in range(model.block):
                                s = attention_addr(
                                    model, st, tp_p, sg.kernel_size, part, sb, hp, tok
                                )
                                d = attention_addr(
                                    model, dt, tp_d, dg.kernel_size, part, db, hd, tok
                                )
                                out.setdefault(q, []).append((s, d, model.head_bytes))
            elif dt.tensor == "conv":
                for sub, total in (
                    ("q", model.key_dim),
                    ("k", model.key_dim),
                    ("v", model.value_dim),
                ):
                    n_p, n_d = total // tp_p, total // tp_d
                    for g in range(rank * n_d, (rank + 1) * n_d):
                        q = g // n_p
                        st = p_tensors[q][key]
                        for row in range(model.state_len):
                            so = conv_offset(model, tp_p, sub, g % n_p, row)
                            do = conv_offset(model, tp_d, sub, g % n_d, row)
                            for sb, db in pairs:
                                s = st.addr + sb * st.block_stride + so
                                d = dt.addr + db * dt.block_stride + do
                                out.setdefault(q, []).append((s, d, CHANNEL))
            else:  # ssm
                n_p, n_d = model.v_heads // tp_p, model.v_heads // tp_d
                for g in range(rank * n_d, (rank + 1) * n_d):
                    q = g // n_p
                    st = p_tensors[q][key]
                    for sb, db in pairs:
                        s = st.addr + sb * st.block_stride + (g % n_p) * model.ssm_head_bytes
                        d = dt.addr + db * dt.block_stride + (g % n_d) * model.ssm_head_bytes
                        out.setdefault(q, []).append((s, d, model.ssm_head_bytes))
    return out
