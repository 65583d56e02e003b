"""The vLLM adapter: a KV connector (``KVBridgeConnector``) built on kvbridge's core.

Importing this package does not import vLLM; ``connector`` does.
"""
