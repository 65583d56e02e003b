"""Workloads for ``kvbridge bench`` and ``kvbridge demo``: not part of kvbridge's API.

``shapes``: real models' KV-cache shapes turned into layout specs (the benchmarks' cases, the
demo's model). ``layouts``: the example layouts and requests shipped under ``examples/`` and the
block ids a request draws from a fragmented pool. Transfers, planning and the control plane never
import them; they describe what the bench and demo move.
"""
