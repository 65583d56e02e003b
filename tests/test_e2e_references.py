"""The e2e stage's references kept on disk (``tests/adapters/vllm/e2e/references.py``).

What they hold is a real vLLM instance's outputs, built by ``make e2e-references`` and compared
against in every e2e run; here a stand-in builder (a model folder and made-up outputs) checks
only how they are kept: read back as stored, rebuilt when a build stopped half-way, and the
folders of other keys removed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e import references
from tests.adapters.vllm.e2e.references import References, cache_key, needed
from tests.adapters.vllm.e2e.run_pd import CASES, Reference


def _fake_build(calls: list[str]):  # type: ignore[no-untyped-def]
    def build(case, root: Path, max_tokens: int = 32, tp: int = 1) -> Reference:  # type: ignore[no-untyped-def]
        calls.append(case.name)
        model = root / case.arch
        if not (model / "config.json").exists():  # as ModelCase.build: built once
            model.mkdir(parents=True)
            (model / "config.json").write_text("{}")
            (model / "weights").write_text(f"built {len(calls)}")
        return Reference(
            case, str(model), [[1, 2, 3]], [4, 3], [[7, 8]], [9], [[5, 6]], [[0.125, 0.5]],
            [[-0.1, -1e-9]], repeat_hit=16 * tp, accepted=[0.75],
        )  # fmt: skip

    return build


def test_a_built_reference_is_read_back_as_it_was_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(references, "build_reference", _fake_build(calls))
    first = References(tmp_path / "key")
    built = first.get("llama_chunked", tp=2)
    assert first.get("llama_chunked", tp=2) is built and calls == ["llama_chunked"]

    again = References(tmp_path / "key")
    read = again.get("llama_chunked", tp=2)
    assert calls == ["llama_chunked"]  # nothing built again
    assert again.loaded == [("llama_chunked", 2)] and not again.built
    assert dataclasses.asdict(read) == dataclasses.asdict(built)
    assert Path(read.model) == tmp_path / "key" / "models" / "llama"
    # another case of the same model uses the stored model: only its outputs are built
    again.get("llama")
    assert calls == ["llama_chunked", "llama"]
    assert (tmp_path / "key" / "models" / "llama" / "weights").read_text() == "built 1"


def test_a_model_whose_build_stopped_half_way_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(references, "build_reference", _fake_build(calls))
    half = tmp_path / "key" / "models" / "deepseek_mla"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # written first: ModelCase.build would take it
    (half / "stale").write_text("x")
    References(tmp_path / "key").get("deepseek_mla")
    assert not (half / "stale").exists() and (half / "weights").exists()


def test_a_new_key_removes_the_folders_of_other_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(references, "build_reference", _fake_build([]))
    monkeypatch.setattr(references, "CACHE", tmp_path)
    old = tmp_path / "0123456789abcdef"
    (old / "models").mkdir(parents=True)
    keep = tmp_path / "references.log"  # not a key's folder
    keep.write_text("log")
    References(tmp_path / "fedcba9876543210").get("llama")
    assert not old.exists() and keep.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedcba9876543210", "references.log"]


def test_the_key_changes_with_the_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key()
    assert len(key) == 16 and key == cache_key()
    real = references.version
    monkeypatch.setattr(
        references, "version", lambda dist: "9.9.9" if dist.startswith("vllm") else real(dist)
    )
    assert cache_key() != key


def test_every_reference_the_e2e_stage_asks_for_is_built_ahead() -> None:
    from tests.adapters.vllm.e2e.test_pd import RUNS, SPECULATIVE
    from tests.adapters.vllm.e2e.test_tp import PP_RUNS
    from tests.adapters.vllm.e2e.test_tp import RUNS as TP_RUNS

    asked = {(name, 1) for name, _ in RUNS} | {(name, 1) for name in SPECULATIVE}
    asked |= {(name, tp_d) for name, *_, tp_d in TP_RUNS} | {(name, 1) for name, *_ in PP_RUNS}
    asked |= {("llama_chunked", 1), ("llama_xpyd", 1), ("llama", 1), ("qwen3_next", 1)}
    assert asked <= set(needed()) and {n for n, _ in needed()} == set(CASES)
