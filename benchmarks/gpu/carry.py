"""The wheels the GPU check carries to a machine with no package registry, fetched and sized here.

The GPU machine has Python 3.12, torch for CUDA 13, numpy, rich, xxhash and pytest, but no NIXL,
msgspec, pyzmq or stevedore, and no network: the wheels travel with the working tree, whose
whole size (the repository's tracked files and the wheels) must stay within the machine's limit
(64 MiB a call).

``python -m benchmarks.gpu.carry fetch`` downloads exactly ``WHEELS`` for CPython 3.12 on
manylinux x86-64 into ``WHEEL_DIR`` (ignored by git), builds kvbridge's own wheel there (its
entry points name the transports), strips from NIXL's CUDA wheel what the check
never loads (``STRIP``: its expert-parallel extension, built for other torch versions, 28 MB of the
wheel's 59), and checks the total against the limit; ``check`` only sizes what is there. On the GPU
machine the wheels install with ``pip install --no-index --no-deps --target``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Where the carried wheels lie (``.gitignore`` keeps them out of the repository).
WHEEL_DIR = REPO / ".whl-gpu"
#: What the GPU machine lacks, pinned: NIXL's selector and its CUDA 13 build, kvbridge's two
#: compiled dependencies and its plugin loader (the versions this repository's environment runs).
WHEELS = (
    "nixl==1.5.1",
    "nixl-cu13==1.5.1",
    "msgspec==0.23.0",
    "pyzmq==27.3.0",
    "stevedore==5.10.0",
)
#: Path prefixes inside a wheel that the check never imports.
STRIP = {"nixl_cu13": ("nixl_ep_cu13/",)}
#: What one call to the GPU machine may carry: the working tree and the wheels together.
LIMIT_BYTES = 64 << 20
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


class CarryError(RuntimeError):
    """The carried set cannot be made (a download failed) or does not fit."""


def strip_wheel(path: Path, prefixes: tuple[str, ...]) -> int:
    """Rewrite the wheel at ``path`` without the members under ``prefixes``, its ``RECORD``
    listing only what stays (pip installs from it as from the original); bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [n for n in src.namelist() if not n.startswith(prefixes)]
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        for name in names:
            if name == record:
                continue
            dst.writestr(src.getinfo(name), src.read(name))
        if record is not None:
            kept = [
                line
                for line in src.read(record).decode().splitlines()
                if line and not line.split(",", 1)[0].startswith(prefixes)
            ]
            dst.writestr(src.getinfo(record), "\n".join(kept) + "\n")
    tmp.replace(path)
    return before - path.stat().st_size


def record_is_consistent(path: Path) -> bool:
    """Every member of the wheel is in its ``RECORD`` with its own hash, and nothing else is."""
    with zipfile.ZipFile(path) as whl:
        names = {n for n in whl.namelist() if not n.endswith("/")}  # directory entries aside
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed: dict[str, str] = {}
        for line in whl.read(record).decode().splitlines():
            name, digest, _ = line.rsplit(",", 2)
            listed[name] = digest
        if set(listed) != names:
            return False
        for name, digest in listed.items():
            if name == record or not digest:
                continue
            algo, _, value = digest.partition("=")
            raw = hashlib.new(algo, whl.read(name)).digest()
            if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != value:
                return False
    return True


def tracked_bytes(repo: Path = REPO) -> int:
    """The size of the repository's tracked files: what travels with every call."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z"], check=True, capture_output=True
    ).stdout
    return sum((repo / name).stat().st_size for name in out.decode().split("\0") if name)


@dataclass(frozen=True)
class Sizes:
    """What one call to the GPU machine carries, in bytes."""

    wheels: dict[str, int]
    tree: int
    limit: int = LIMIT_BYTES

    @property
    def total(self) -> int:
        return self.tree + sum(self.wheels.values())

    def table(self) -> str:
        rows = [f"{name:80} {size / 2**20:8.2f} MiB" for name, size in sorted(self.wheels.items())]
        rows.append(f"{'tracked files of the repository':80} {self.tree / 2**20:8.2f} MiB")
        rows.append(
            f"{'total (limit ' + f'{self.limit / 2**20:.0f} MiB)':80} {self.total / 2**20:8.2f} MiB"
        )
        return "\n".join(rows)


def sizes(wheel_dir: Path = WHEEL_DIR, repo: Path = REPO) -> Sizes:
    """The carried wheels' sizes and the tree's; raises ``CarryError`` when a wheel is missing."""
    found = {p.name: p.stat().st_size for p in sorted(wheel_dir.glob("*.whl"))}
    for pin in (*WHEELS, "kvbridge==" + _version(repo)):
        prefix = pin.split("==")[0].replace("-", "_") + "-" + pin.split("==")[1] + "-"
        if not any(name.startswith(prefix) for name in found):
            raise CarryError(
                f"{pin} is not in {wheel_dir}: run python -m benchmarks.gpu.carry fetch"
            )
    return Sizes(found, tracked_bytes(repo))


def _version(repo: Path) -> str:
    import tomllib

    return str(tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"])


def fetch(wheel_dir: Path = WHEEL_DIR) -> None:
    """Download ``WHEELS`` for the GPU machine's Python and strip them (``STRIP``)."""
    wheel_dir.mkdir(exist_ok=True)
    for stale in wheel_dir.glob("*.whl"):
        stale.unlink()  # one version of each: two stop the install there
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(wheel_dir)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    done = subprocess.run([*cmd, *WHEELS], capture_output=True, text=True)
    if done.returncode != 0:
        raise CarryError(f"pip download failed: {done.stderr.strip().splitlines()[-1:]}")
    # kvbridge itself, so that its entry points (the transports, the pytest plugin) are there
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*build, "-w", str(wheel_dir), str(REPO)], capture_output=True, text=True)
    if done.returncode != 0:
        raise CarryError(f"building kvbridge's wheel failed: {done.stderr.strip()[-300:]}")
    for wheel in wheel_dir.glob("*.whl"):
        prefixes = STRIP.get(wheel.name.split("-")[0], ())
        if prefixes:
            saved = strip_wheel(wheel, prefixes)
            print(f"stripped {wheel.name}: {saved / 2**20:.1f} MiB of {', '.join(prefixes)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("fetch", "check"))
    ap.add_argument("--dir", type=Path, default=WHEEL_DIR)
    args = ap.parse_args(argv)
    try:
        if args.action == "fetch":
            fetch(args.dir)
        found = sizes(args.dir)
    except CarryError as err:
        print(f"carry: {err}", file=sys.stderr)
        return 2
    print(found.table())
    if found.total > found.limit:
        print(
            f"carry: {found.total / 2**20:.1f} MiB exceeds the {found.limit / 2**20:.0f} MiB a "
            "call carries: strip more (STRIP) or carry fewer wheels",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
