"""Caches in GPU memory: registered as that GPU's memory, and no integrity check that would read
them from the CPU (which would take the engine down). What runs here without a GPU; the GPU
check (``benchmarks/gpu``) moves real VRAM."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.control.plane import ControlPlane
from kvbridge.core import Layout
from kvbridge.core.integrity import unreadable_here
from kvbridge.core.memory import MemoryKind
from kvbridge.testing.loopback import LoopbackTransport

from .layouts import Arena, hybrid_layout


def on_gpu(layout: Layout, device: int) -> Layout:
    return Layout(msgspec.structs.replace(layout.spec, vram_device=device))


def test_a_layout_on_a_gpu_registers_that_gpus_memory() -> None:
    host = hybrid_layout(Arena())
    gpu = on_gpu(host, 3)
    assert {r.kind for r in host.registration} == {MemoryKind.DRAM}
    assert {(r.kind, r.device_id) for r in gpu.registration} == {(MemoryKind.VRAM, 3)}
    assert [(r.addr, r.size) for r in gpu.registration] == [
        (r.addr, r.size) for r in host.registration
    ]
    assert unreadable_here(host) == ""
    assert "GPU memory (device 3)" in unreadable_here(gpu)
    # a peer of an older kvbridge sends no vram_device: host memory
    assert msgspec.json.decode(msgspec.json.encode(host.spec), type=type(host.spec)) == host.spec


def test_verify_is_refused_in_one_line_for_caches_in_gpu_memory() -> None:
    gpu = on_gpu(hybrid_layout(Arena()), 0)
    with pytest.raises(ValueError, match=r"^verify=full: the KV caches lie in GPU memory"):
        ControlPlane(gpu, LoopbackTransport(), verify="full")
    host = hybrid_layout(Arena())
    with ControlPlane(host, LoopbackTransport(), verify="sample", timeout=5) as plane:
        plane.verify = "off"
        assert plane.verify.value == "off"
