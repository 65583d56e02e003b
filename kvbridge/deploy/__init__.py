"""The deploy scripts shipped in the wheel (``prefill.sh``, ``decode.sh``, ``one-host.sh``, ...).

``kvbridge deploy-scripts DIR`` copies them out of the installed package, so a pip install has
the same scripts as a checkout's ``examples/deploy``.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

__all__ = ["SCRIPTS", "copy_scripts", "scripts_dir"]

#: The scripts, in the order a reader meets them.
SCRIPTS = ("one-host.sh", "prefill.sh", "decode.sh", "router.sh", "proxy.sh", "common.sh")


def scripts_dir() -> Path:
    """The installed package's folder of deploy scripts."""
    return Path(str(resources.files(__name__)))


def copy_scripts(dest: Path) -> list[Path]:
    """Copy every script into ``dest`` (made if missing), executable; return the copies.

    Raises:
        FileExistsError: a script of that name is already in ``dest`` (nothing was copied).
    """
    source = scripts_dir()
    dest.mkdir(parents=True, exist_ok=True)
    taken = [name for name in SCRIPTS if (dest / name).exists()]
    if taken:
        raise FileExistsError(f"{dest} already has {', '.join(taken)}")
    copies = []
    for name in SCRIPTS:
        target = dest / name
        shutil.copyfile(source / name, target)
        target.chmod(0o755)
        copies.append(target)
    return copies
