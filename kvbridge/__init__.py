"""kvbridge: KV-cache transfer for prefill/decode disaggregated serving, any transport."""

from kvbridge.core.registry import (
    available_transports,
    load_transport,
    register_transport,
    unregister_transport,
)

__all__ = [
    "available_transports",
    "load_transport",
    "register_transport",
    "unregister_transport",
    "__version__",
]
__version__ = "0.1.0"
