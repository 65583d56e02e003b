"""The conformance suite's parts: each mixin runs alone, and ``TransportConformance`` is all four.

The suite's own cases run against real transports in ``tests/transports``; here only what a test
class made of some of the parts collects.
"""

from __future__ import annotations

import textwrap

import pytest

from kvbridge.testing import (
    ConformanceBase,
    DataPathTests,
    FaultAndFenceTests,
    PeerLifecycleTests,
    RegistrationTests,
    TransportConformance,
)

pytest_plugins = ["pytester"]

PARTS = (DataPathTests, RegistrationTests, PeerLifecycleTests, FaultAndFenceTests)


def _tests(cls: type) -> set[str]:
    return {name for name in dir(cls) if name.startswith("test_")}


def test_the_parts_split_the_whole_suite() -> None:
    owned = [set(vars(part)) & _tests(part) for part in PARTS]
    assert all(owned), "a part without tests"
    assert sum(map(len, owned)) == len(set().union(*owned)), "a test in two parts"
    assert set().union(*owned) == _tests(TransportConformance)
    assert not _tests(ConformanceBase)


def test_a_part_alone_collects_only_its_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_subset=textwrap.dedent(
            """
            from kvbridge.testing import PeerLifecycleTests, RegistrationTests


            class TestSubset(PeerLifecycleTests, RegistrationTests):
                name = "cma"
            """
        )
    )
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    collected = [line for line in result.outlines if "::" in line]
    prefix = "test_subset.py::TestSubset::"
    expected = sorted(_tests(PeerLifecycleTests) | _tests(RegistrationTests))
    assert sorted(line.removeprefix(prefix) for line in collected) == expected
    assert all(line.startswith(prefix) for line in collected)


def test_only_a_test_class_must_name_its_transport() -> None:
    class Shared(DataPathTests, abstract=True):  # a base for a plugin's own test classes
        pass

    class TestNamed(Shared):
        name = "cma"

    assert _tests(TestNamed) == _tests(DataPathTests)
    with pytest.raises(TypeError, match="must set the transport entry-point name"):

        class TestUnnamed(FaultAndFenceTests):
            pass
