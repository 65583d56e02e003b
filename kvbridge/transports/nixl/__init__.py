"""NIXL transport (entry point ``nixl``), UCX backend by default."""

from kvbridge.transports.nixl.transport import (
    INSTALL_COMMAND,
    NixlMetadata,
    NixlTransport,
    exit_cleanly,
)

__all__ = ["INSTALL_COMMAND", "NixlMetadata", "NixlTransport", "exit_cleanly"]
