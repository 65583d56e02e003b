"""D's half of a transpose on receive: permute the received blocks in vLLM's own cache tensors.

The core says which kernel blocks of which group landed in P's order
(``kvbridge.core.transpose.received_transposes``); this module permutes them through vLLM's
per-layer views ``[kernel blocks, H, N, C]``, on whatever device the cache lives (a gather, a
permute and a scatter per layer: no host copy, no Python loop over blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvbridge.core.transpose import Transpose


def transpose_received(
    views: Mapping[str, torch.Tensor],
    layers_of_group: Sequence[Sequence[str]],
    transposes: Sequence[Transpose],
) -> None:
    """Rewrite each transposed block of each layer of its group in this side's own order.

    ``views``: vLLM's cache view per layer (``[B*ratio, H, N, C]``, as registered);
    ``layers_of_group[g]``: the layer names of cache group ``g``. Call it after the transfer
    ended and before the engine reads the blocks.
    """
    for transpose in transposes:
        for layer in layers_of_group[transpose.group_index]:
            view = views[layer]
            _, heads, tokens, content = view.shape
            if heads == 1 or tokens == 1:
                continue  # one head (or one token): both orders are the same bytes
            ids = torch.as_tensor(transpose.kernel_block_ids, dtype=torch.long, device=view.device)
            blocks = view.index_select(0, ids)  # logical [n, H, N, C], a copy
            n = blocks.shape[0]
            if transpose.to_head_major:
                # The heads' runs, in order, hold P's [N, H, C] block.
                arrived = blocks.reshape(n, tokens, heads, content).transpose(1, 2)
            else:
                # The [N, H, C] block holds P's [H, N, C] block.
                arrived = blocks.transpose(1, 2).reshape(n, heads, tokens, content)
            view.index_copy_(0, ids, arrived)
