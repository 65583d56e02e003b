"""Same-host transport over Linux cross-memory attach (entry point ``cma``)."""

from kvbridge.transports.cma.transport import CmaMetadata, CmaTransport

__all__ = ["CmaMetadata", "CmaTransport"]
