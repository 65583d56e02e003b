"""P and D at different TP sizes on real vLLM engines: D's greedy tokens against one instance.

vLLM's CPU backend runs TP 2 with one core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
TP ranks round differently from one rank (bf16), so D is compared with a single instance at
D's TP size: exactly in float32, near ties allowed in bf16 (``TP_TIE``). Each case also
runs the control (prompt 0's KV under other tokens): D's answer is prompt 0's, so D decoded
over what it loaded from P's ranks, not over a recompute.

Marked ``e2e`` (run by ``make test`` with ``KVBRIDGE_E2E=1``): three engines per case.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.run_pd import Reference, run_pair
from tests.adapters.vllm.e2e.test_pd import (
    RESULTS,
    check_landed,
    check_layerwise,
    layers_moved,
)

pytestmark = E2E

#: (model, transport, mode, P's TP size, D's TP size): both directions, MLA, the GDN hybrid,
#: whose attention layers split their KV heads across D's ranks as a dense model's do (Llama
#: TP 1 -> 2 over Mooncake ran here too until the CI time asked for a pair fewer: dense TP slices
#: in both directions, over every transport, run rank by rank in tests/control/test_tp.py). Each
#: pair also runs every prompt layer-wise (the concurrent dispatch, P's ranks streaming to D's;
#: the TP 2 P in both layer-wise modes).
RUNS = [
    ("deepseek_mla", "nixl", "push", 2, 1),
    ("qwen3_next", "nixl", "pull", 1, 2),
]
#: The hybrid at TP 2: its 33-token prompt parts from the TP 2 single instance at step 1, where
#: that instance's two best tokens are 0.3125 apart and D takes the runner-up; P TP 1 and P TP 2
#: (bytes copied rank to rank) part there alike, so it is vLLM's split computation at TP 2, within
#: the bf16 bound (``run_pd.BF16_BOUND``). The bytes of the hybrid's TP slices are checked
#: exactly in tests/control/test_tp.py and tests/adapters/vllm/test_layout_tp.py.


def consecutive_free_ports(count: int, start: int = 6200) -> int:
    """A base port with ``count`` free ports from it (TP rank r binds base + r)."""
    for base in range(start, start + 2000, 10):
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports from {start}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "transport", "mode", "tp_p", "tp_d"), RUNS)
def test_tp_pair_matches_single_instance_at_d_tp(
    name: str,
    transport: str,
    mode: str,
    tp_p: int,
    tp_d: int,
    reference: Callable[..., Reference],
) -> None:
    ref = reference(name, tp=tp_d)
    port_p = consecutive_free_ports(tp_p, 6200)
    port_d = consecutive_free_ports(tp_d, port_p + 10)
    # the layer-wise dispatch in the same mode (P writes each layer, or D reads it); from a TP 2
    # P in both (each of P's ranks streams its slice to D's one rank)
    layerwise = (
        ("layerwise", "layerwise-pull")
        if tp_p > 1
        else (("layerwise",) if mode == "push" else ("layerwise-pull",))
    )
    summary = run_pair(
        ref,
        transport,
        modes=(mode, *layerwise),
        port_p=port_p,
        port_d=port_d,
        kill_check=False,
        freeze_check=False,
        tp_p=tp_p,
        tp_d=tp_d,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"tp-{name}-{transport}-{tp_p}to{tp_d}.json").write_text(
        json.dumps(summary, indent=1)
    )
    rows = summary["results"]
    assert len(rows) == (1 + len(layerwise)) * len(ref.prompts)
    check_layerwise(name, rows)
    check_landed(rows)
    bad = [(r["prompt"], r["d_tokens"], r["ref_tokens"]) for r in rows if r["match"] == "mismatch"]
    assert not bad, f"D (TP {tp_d}) differs from the single instance at TP {tp_d}: {bad}"
    if ref.case.tie == 0:
        assert all(r["match"] == "exact" for r in rows)
    assert summary["control"]["loaded"], "D did not decode over P's KV (control prompt)"
    assert summary["prefix_hit"], "the repeated prompt's prefix hit is not as documented"


#: (model, transport, modes, P's stages, D's stages): both directions, each whole-request mode
#: and each layer-wise one once (every stage of P streams its own layers as it computes them).
PP_RUNS = [
    ("llama", "mooncake", ("pull", "layerwise"), 2, 1),
    ("llama", "nixl", ("push", "layerwise-pull"), 1, 2),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "transport", "modes", "pp_p", "pp_d"), PP_RUNS)
def test_pipeline_stages_match_single_instance(
    name: str,
    transport: str,
    modes: tuple[str, ...],
    pp_p: int,
    pp_d: int,
    reference: Callable[..., Reference],
) -> None:
    """P and D of different pipeline-parallel sizes (vLLM's own split of the layers into
    stages, one core per stage): D's tokens equal the single instance's (float32: exactly;
    stages compute what one worker does), and every load moved every layer of the model from
    whichever P stage holds it to whichever D stage does."""
    ref = reference(name)
    port_p = consecutive_free_ports(pp_p, 6400)
    port_d = consecutive_free_ports(pp_d, port_p + 10)
    summary = run_pair(
        ref, transport, modes=modes, port_p=port_p, port_d=port_d,
        kill_check=False, freeze_check=False, pp_p=pp_p, pp_d=pp_d,
    )  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"pp-{name}-{transport}-{pp_p}to{pp_d}.json").write_text(
        json.dumps(summary, indent=1)
    )
    rows = summary["results"]
    assert {r["mode"] for r in rows} == set(modes)
    bad = [(r["mode"], r["prompt"]) for r in rows if r["match"] != "exact"]
    assert not bad, f"D (PP {pp_d}) differs from the single instance: {bad}"
    layers = json.loads((Path(ref.model) / "config.json").read_text())["num_hidden_layers"]
    block = ref.case.block_size or 0
    loads = [r for r in rows if r["d_loaded_bytes"]]
    assert len(loads) >= len(rows) - 2 * len(modes), rows  # a full hit on D loads nothing
    moved = {(r["mode"], r["prompt"]): layers_moved(ref.model, block, r) for r in loads}
    assert set(moved.values()) == {float(layers)}, moved
    check_layerwise(name, rows)
    check_landed(rows)
    assert summary["control"]["loaded"], "D did not decode over P's KV (control prompt)"
