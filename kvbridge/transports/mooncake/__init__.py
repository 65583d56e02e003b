"""Mooncake Transfer Engine transport (entry point ``mooncake``)."""

from kvbridge.transports.mooncake.transport import MooncakeHandle, MooncakeTransport

__all__ = ["MooncakeHandle", "MooncakeTransport"]
