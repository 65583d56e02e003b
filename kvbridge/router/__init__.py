"""The P/D router side: kvbridge's proxy app, its command line, and what a router agrees on
with the connector (the concurrent dispatch, vllm-router's bootstrap ``/query``).

It needs no vLLM (the ``proxy`` extra brings the app's web stack) and imports nothing of
``kvbridge.adapters``; the vLLM connector imports ``dispatch`` and ``bootstrap`` from here.
Importing this package imports none of its modules.
"""
