"""What differs between vLLM releases, read in one module (``versions.py``)."""

from __future__ import annotations

import pytest
import vllm

from kvbridge.adapters.vllm.versions import TESTED, untested_release


def test_the_installed_vllm_is_a_tested_release() -> None:
    """Each job of ``make test`` (0.32 engines, 0.33's and 0.34's Python layers) runs a release
    inside the tested range, so no warning is logged there."""
    assert untested_release(vllm.__version__) is None, vllm.__version__


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0", "0.34.2rc1"])
def test_tested_releases_need_no_warning(version: str) -> None:
    assert untested_release(version) is None


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0"])
def test_other_releases_get_one_line_naming_the_range(version: str) -> None:
    warning = untested_release(version)
    assert warning is not None and "\n" not in warning
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    assert f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}, not {version}" in warning
    assert "make test-vllm-latest" in warning
