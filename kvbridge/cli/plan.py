"""``kvbridge plan``: what a request would move between two layouts, without moving it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from kvbridge.cli.arguments import read_json, read_layout
from kvbridge.cli_errors import CliError
from kvbridge.core.batches import TransferOp
from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.errors import KvbridgeError
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.transpose import received_transposes


class RequestBlocks(msgspec.Struct, forbid_unknown_fields=True):
    """The block-id file of ``kvbridge plan``: logical ids per group index, for each side.

    ``prompt_tokens``, when given, is checked against the ids: each group must hold the blocks
    the tokens decode loads take (N-1 of them with recurrent state, ``kvbridge.core.boundary``).
    """

    prefill: dict[int, list[int]]
    decode: dict[int, list[int]]
    prompt_tokens: int | None = None


def _read_blocks(path: Path) -> RequestBlocks:
    try:
        return msgspec.json.decode(read_json(path, "block-id file"), type=RequestBlocks)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise CliError(f"block-id file {str(path)!r}: {err}") from None


def _loaded_tokens(blocks: RequestBlocks, prefill: Layout, decode: Layout, path: Path) -> int:
    """The tokens decode loads for ``blocks.prompt_tokens``, once every group's ids on both
    sides are checked to hold just the blocks those tokens take."""
    prompt = blocks.prompt_tokens
    assert prompt is not None
    where = f"block-id file {str(path)!r}"
    if prompt < 1:
        raise CliError(f"{where}: prompt_tokens must be at least 1, got {prompt}")
    loaded = remote_prefill_token_count(prompt, prefill.has_state)
    why = f"decode loads N-1 = {loaded:,}" if prefill.has_state else "decode loads all"
    for side, layout, ids in (
        ("prefill", prefill, blocks.prefill),
        ("decode", decode, blocks.decode),
    ):
        for index, group in sorted(layout.groups.items()):
            if index not in ids:
                continue  # the planner names a missing group
            want = blocks_for_tokens(loaded, group.block_size)
            got = len(ids[index])
            if got != want and not (group.kind is GroupKind.STATE and want == 0 and got <= 1):
                raise CliError(
                    f"{where}: {side} group {index} holds {got} block ids, but prompt_tokens "
                    f"{prompt:,} ({why}) takes {want} blocks of {group.block_size} tokens; fix "
                    "the ids or prompt_tokens, or leave prompt_tokens out"
                )
    return loaded


def _plan_table(plan: TransferPlan, title: str) -> Table:
    table = Table(title=title)
    for column in ("group", "kind", "regions", "blocks", "descriptors", "bytes"):
        table.add_column(column, justify="right")
    for g in plan.groups:
        table.add_row(
            str(g.group_index),
            g.kind.value,
            str(g.regions),
            str(g.blocks),
            str(g.descriptors),
            f"{g.nbytes:,}",
        )
    table.add_section()
    table.add_row(
        "all",
        "",
        str(sum(g.regions for g in plan.groups)),
        "",
        str(plan.unmerged),
        f"{plan.nbytes:,}",
    )
    return table


def _plan_summary(plan: TransferPlan, elapsed: float) -> str:
    return (
        f"descriptors: {plan.unmerged} before merging, {plan.count} after; "
        f"{plan.nbytes:,} bytes; planned in {elapsed * 1e3:.2f} ms"
    )


def boundary_text(prompt_tokens: int, loaded: int, has_state: bool) -> str:
    """What ``remote prefill tokens`` means for this model (``kvbridge.core.boundary``)."""
    if has_state:
        return (
            f"remote prefill tokens: {loaded:,} of the {prompt_tokens:,}-token prompt (N-1: the "
            "model has recurrent state, so decode computes the last prompt token itself)"
        )
    return (
        f"remote prefill tokens: {loaded:,}, the whole {prompt_tokens:,}-token prompt (the "
        "model has no recurrent state)"
    )


def run(args: argparse.Namespace, console: Console) -> int:
    prefill = read_layout(args.prefill, "prefill layout")
    decode = read_layout(args.decode, "decode layout")
    blocks = _read_blocks(args.blocks)
    op = TransferOp(args.op)
    loaded = None
    if blocks.prompt_tokens is not None:
        loaded = _loaded_tokens(blocks, prefill, decode, args.blocks)
    try:
        plan = plan_transfers(
            prefill, decode, blocks.prefill, blocks.decode, merge=not args.no_merge
        )
    except KvbridgeError as err:
        raise CliError(str(err)) from None
    # Time a second, warm call: the first pays for numpy's lazy imports.
    start = time.perf_counter()
    plan_transfers(prefill, decode, blocks.prefill, blocks.decode, merge=not args.no_merge)
    elapsed = time.perf_counter() - start
    transposes = received_transposes(prefill, decode, blocks.prefill, blocks.decode)
    if args.json:
        local, remote, lengths = plan.local_remote(op)
        doc: dict[str, Any] = {
            "op": op.value,
            "submitter": "decode" if op is TransferOp.READ else "prefill",
            "descriptors_before_merge": plan.unmerged,
            "descriptors": plan.count,
            "bytes": plan.nbytes,
            "prompt_tokens": blocks.prompt_tokens,
            "remote_prefill_tokens": loaded,
            "groups": [{**g.__dict__, "kind": g.kind.value} for g in plan.groups],
            # kernel blocks decode permutes after the transfer, per group (token- vs head-major)
            "transposed_on_receive": {
                str(t.group_index): int(t.kernel_block_ids.size) for t in transposes
            },
            "local": local.tolist(),
            "remote": remote.tolist(),
            "length": lengths.tolist(),
        }
        print(json.dumps(doc))
        return 0
    side = "decode reads from prefill" if op is TransferOp.READ else "prefill writes to decode"
    console.print(_plan_table(plan, f"transfer plan ({side})"))
    console.print(_plan_summary(plan, elapsed), soft_wrap=True)
    if blocks.prompt_tokens is not None and loaded is not None:
        boundary = boundary_text(blocks.prompt_tokens, loaded, prefill.has_state)
        console.print(f"{boundary}; every group's block ids checked against it", soft_wrap=True)
    for t in transposes:
        order = "[N,H,C] into its heads" if t.to_head_major else "[H,N,C] into [N,H,C]"
        console.print(
            f"group {t.group_index}: decode transposes {t.kernel_block_ids.size} kernel blocks "
            f"after the transfer (prefill's {order})",
            soft_wrap=True,
        )
    return 0


def add_parser(sub: Any) -> None:
    """Add this command to the ``kvbridge`` parser's subcommands."""
    p = sub.add_parser("plan", help="show what a request would move between two layouts")
    p.add_argument("prefill", type=Path, help="prefill (source) layout JSON")
    p.add_argument("decode", type=Path, help="decode (destination) layout JSON")
    p.add_argument("blocks", type=Path, help="block ids JSON: {prefill: {group: [ids]}, decode: …}")
    p.add_argument(
        "--op",
        choices=[o.value for o in TransferOp],
        default="read",
        help="read: decode pulls (default); write: prefill pushes",
    )
    p.add_argument("--no-merge", action="store_true", help="do not merge adjacent descriptors")
    p.add_argument("--json", action="store_true", help="print the descriptors as JSON")
    p.set_defaults(func=run)
