"""Mooncake Transfer Engine transport (entry point ``mooncake``)."""

from kvbridge.transports.mooncake.transport import MooncakeMetadata, MooncakeTransport

__all__ = ["MooncakeMetadata", "MooncakeTransport"]
