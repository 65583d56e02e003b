"""Benchmark scripts of the source tree, not shipped in the ``kvbridge`` wheel.

Each runs as ``python benchmarks/NAME.py`` or ``python -m benchmarks.NAME`` from the repository
root; a package so that the tests and the other scripts import them as ``benchmarks.NAME``.
"""
