"""P → D through ``KVBridgeConnector`` on two real vLLM engines, checked against one instance.

Every model x transport runs one engine pair through ``run_pd.run_pair``: each prompt in pull and
push mode and layer-wise (the concurrent dispatch: D gets the request while P computes it, P
writes each layer as it is computed) (token ids over 32 greedy tokens equal to the single
instance), a repeated prompt
served partly from D's prefix cache, a control proving D decoded over P's KV, and P killed
before D loads (D recomputes and still matches). The single-instance reference is computed once
per model and shared by both transports.

Slow (an engine starts in 30-90 s here): marked ``e2e``, run by ``make test`` (``make test-e2e``)
with ``KVBRIDGE_E2E=1``; skipped with that reason otherwise. Each run's summary is written to
``.e2e-results/`` (D's time to first token, per prompt and mode) for the record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbridge.bench.pages import cpu_bf16_isa
from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.run_pd import CHUNK_TOKENS, LAYERWISE, MODES, Reference, run_pair

pytestmark = E2E

RESULTS = Path(__file__).resolve().parents[4] / ".e2e-results"
TRANSPORTS = ("mooncake", "nixl")


#: MLA float32 with both transports; Llama float32, the hybrid and the bf16 MLA (within
#: BF16_BOUND) with Mooncake. Over NIXL, Llama runs in test_tp (PP 1 -> 2: push and layer-wise
#: pull), the hybrid in test_tp (P TP 1 -> D TP 2), and every model's bytes in the control-plane
#: tests; NIXL's P killed and frozen run here with MLA: engine pairs fewer keep CI under the hour.
RUNS = [
    *(("deepseek_mla", t) for t in TRANSPORTS),
    ("llama", "mooncake"),
    ("qwen3_next", "mooncake"),
    ("deepseek_mla_bf16", "mooncake"),
]


#: Models with a recurrent state (GDN): P sends it at publish, once final, not layer by layer.
WITH_STATE = {"qwen3_next"}


def check_layerwise(name: str, rows: list[dict]) -> None:
    """Every layer-wise load (the concurrent dispatch, ``run_pd``'s ``layerwise`` and
    ``layerwise-pull`` modes) came layer by layer as P computed it: all of its bytes, or all
    but the recurrent state's (P sends the last layer's notice before its last word, and D
    submits a told layer's read before it answers the notice)."""
    ran = {r["mode"] for r in rows} & set(LAYERWISE)
    assert ran, "no layer-wise mode ran"
    for mode in ran:
        assert any(r["mode"] == mode and r["d_loaded_bytes"] for r in rows), f"no {mode} load"
    loads = [r for r in rows if r["mode"] in LAYERWISE and r["d_loaded_bytes"]]
    for r in loads:
        streamed, loaded = r["d_streamed_bytes"], r["d_loaded_bytes"]
        if name.split("_bf16")[0] in WITH_STATE:
            assert 0 < streamed < loaded, (r["mode"], r["prompt"], streamed, loaded)
        else:
            assert streamed == loaded, (r["mode"], r["prompt"], streamed, loaded)


def check_landed(rows: list[dict]) -> None:
    """Every load P stamped (all of kvbridge's: P's scheduler stamps its answer) reports when
    its last byte landed after P's answer, through vLLM's metrics hook."""
    for r in rows:
        if r["d_loaded_bytes"]:
            assert r["d_landed_after_s"] and r["d_landed_after_s"] > 0, (r["mode"], r["prompt"])


#: The bf16 cases compare a split computation (P prefills N-1 tokens, D computes the rest) with
#: one instance's: D's log-probs must lie within the case's measured bound of the single
#: instance's at every step the two share, and the tokens may part only at a near tie
#: (``Reference.compare``). The bound holds with and without AMX, so they run on every CPU.
BF16 = {"qwen3_next", "deepseek_mla_bf16"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "transport"), RUNS)
def test_pd_matches_single_instance(
    name: str, transport: str, reference: Callable[[str], Reference]
) -> None:
    ref = reference(name)
    # Distinct side-channel ports per run: a killed P's port may linger in TIME_WAIT.
    offset = 10 * RUNS.index((name, transport))
    summary = run_pair(ref, transport, port_p=5700 + offset, port_d=5800 + offset)
    summary["bf16_isa"] = cpu_bf16_isa()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"pd-{name}-{transport}.json").write_text(json.dumps(summary, indent=1))

    for mode in MODES:
        rows = [r for r in summary["results"] if r["mode"] == mode]
        assert len(rows) == len(ref.prompts)
        bad = [
            (r["prompt"], r["d_tokens"], r["ref_tokens"]) for r in rows if r["match"] == "mismatch"
        ]
        assert not bad, f"{mode}: D's tokens differ from the single instance: {bad}"
        if ref.case.tie == 0:
            assert all(r["match"] == "exact" for r in rows)
    check_layerwise(name, summary["results"])
    check_landed(summary["results"])
    repeats = [
        (r["mode"], r["d_cached"], r["p_cached"], r["d_loaded_bytes"])
        for r in summary["results"]
        if r["repeat"] or r["prompt"] == ref.case.repeat
    ]
    # D's own cache serves part of the repeated prompt and it loads only the rest (or, where
    # the single instance caches nothing of it, no hit anywhere): run_pd.run_pair.
    assert summary["prefix_hit"], f"repeated prompt (mode, D hit, P hit, D loaded B): {repeats}"
    assert ref.case.prefix_cache or not any(r["d_cached"] for r in summary["results"])
    assert summary["control"]["loaded"], "D did not decode over P's KV (control prompt)"
    assert summary["p_frozen"]["match"] != "mismatch", "after P was frozen D's answer was wrong"
    assert summary["p_killed"]["match"] != "mismatch", "after P died D did not recompute correctly"


def chunk_parts(prompt_tokens: int, block: int, cached: int, chunk: int = CHUNK_TOKENS) -> int:
    """The parts a layer-wise load of a chunked prefill comes in: one per chunk that
    completed a block, the last chunk always (it sends every block left); P computes from
    its prefix-cache hit (``cached`` tokens) on."""
    blocks, done, parts = -(-prompt_tokens // block), 0, 0
    for end in range(cached + chunk, prompt_tokens + chunk, chunk):
        upto = blocks if end >= prompt_tokens else min(end // block, blocks)
        if upto > done:
            parts, done = parts + 1, upto
    return parts


#: Chunked prefill on every engine: the whole-request pull beside both layer-wise modes.
CHUNKED_MODES = ("pull", "layerwise", "layerwise-pull")


@pytest.mark.timeout(900)
def test_a_chunked_prefill_streams_each_chunk_and_matches(
    reference: Callable[[str], Reference],
) -> None:
    ref = reference("llama_chunked")
    summary = run_pair(
        ref, "mooncake", modes=CHUNKED_MODES, port_p=5780, port_d=5880, kill_check=False,
        freeze_check=False,
    )  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pd-llama_chunked-mooncake.json").write_text(json.dumps(summary, indent=1))
    rows = summary["results"]
    assert {r["mode"] for r in rows} == set(CHUNKED_MODES)
    bad = [(r["mode"], r["prompt"]) for r in rows if r["match"] != "exact"]
    assert not bad, f"D's tokens differ from the single instance's: {bad}"
    check_layerwise("llama", rows)
    block = ref.case.block_size or 0
    loads = [r for r in rows if r["mode"] in LAYERWISE and r["d_loaded_bytes"]]
    parts = {(r["mode"], r["prompt"]): r["d_streamed_parts"] for r in loads}
    want = {
        (r["mode"], r["prompt"]): chunk_parts(r["prompt_len"], block, r["p_cached"] or 0)
        for r in loads
    }
    for mode in LAYERWISE:  # the prompts do span several chunks in both modes
        assert max(n for (m, _), n in want.items() if m == mode) >= 3, want
    assert parts == want, "the prefill steps each layer-wise load came in"
    assert summary["control"]["loaded"], "D did not decode over P's KV (control prompt)"


def layers_moved(model: str, block: int, row: dict) -> float:
    """How many layers' KV a load of ``row`` moved: its bytes over one float32 attention
    layer's for the blocks D loaded (every block of P's prompt less D's own hit)."""
    config = json.loads((Path(model) / "config.json").read_text())
    if "kv_lora_rank" in config:  # MLA: one latent and its rotary part per token
        per_token = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:  # K and V of every KV head
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_key_value_heads"] * head_dim
    per_block = block * per_token * 4  # float32
    blocks = -(-row["prompt_len"] // block) - (row["d_cached"] or 0) // block
    return float(row["d_loaded_bytes"]) / (blocks * per_block)


#: The speculative cases, and the attention layers their drafter adds to a target of ``n``
#: layers (all in the target's KV cache group): a copy of the target, or one EAGLE layer.
SPECULATIVE = {
    "llama_spec": lambda n: n,
    "llama_eagle": lambda n: 1,
    "deepseek_mla_spec": lambda n: n,
}
#: Their modes, every mode in some case (what a drafter adds does not depend on the mode, and
#: each mode runs without one in RUNS): two each on Llama, one on MLA (CI time).
SPECULATIVE_MODES = {
    "llama_spec": ("pull", "layerwise"),
    "llama_eagle": ("push", "layerwise-pull"),
    "deepseek_mla_spec": ("pull",),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(SPECULATIVE))
def test_speculative_decoding_moves_the_drafters_kv(
    name: str, reference: Callable[[str], Reference]
) -> None:
    """P and D run speculative decoding (2 tokens a step): vLLM's ``draft_model`` method with
    the target's own weights as the draft (nearly every proposal is accepted) on Llama and on
    MLA, and EAGLE with a head of random weights. The drafter's layers share the target's KV
    cache group, and their KV of the prompt moves from P with the target's. D's tokens equal
    the single instance's (running the same method); every load moved the target's layers and
    the drafter's; D's drafter accepts as many tokens per prompt as the single instance's (a
    draft KV that did not come from P proposes other tokens) wherever D's own forward of the
    last token is bit for bit the single instance's (its log-probs equal: Llama); on MLA that
    forward rounds differently (log-probs within 3e-5), which may flip a proposal at a near
    tie: there D accepts at least 90% as many over the run."""
    ref = reference(name)
    modes = SPECULATIVE_MODES[name]
    offset = 2 * sorted(SPECULATIVE).index(name)
    summary = run_pair(
        ref, "mooncake", modes=modes, port_p=5784 + offset, port_d=5884 + offset,
        kill_check=False, freeze_check=False,
    )  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"pd-{name}-mooncake.json").write_text(json.dumps(summary, indent=1))
    rows = summary["results"]
    assert {r["mode"] for r in rows} == set(modes)
    bad = [(r["mode"], r["prompt"]) for r in rows if r["match"] != "exact"]
    assert not bad, f"D's tokens differ from the single instance's: {bad}"
    if ref.case.speculative == "draft_model":
        assert all(a > 0 for a in ref.accepted), f"the single instance accepted {ref.accepted}"
    accepted = [(r["mode"], r["prompt"], r["d_accepted"], r["ref_accepted"]) for r in rows]
    bitwise = [a for a, r in zip(accepted, rows, strict=True) if r["lp_dev"] == 0]
    assert all(d == single for _, _, d, single in bitwise), accepted
    assert sum(a[2] for a in accepted) >= 0.9 * sum(a[3] for a in accepted), accepted
    target = json.loads((Path(ref.model) / "config.json").read_text())["num_hidden_layers"]
    block = ref.case.block_size or 0
    moved = {(r["mode"], r["prompt"]): layers_moved(ref.model, block, r) for r in rows}
    assert set(moved.values()) == {float(target + SPECULATIVE[name](target))}, moved
    if set(modes) & set(LAYERWISE):
        check_layerwise(name, rows)
    assert summary["control"]["loaded"], "D did not decode over P's KV (control prompt)"
