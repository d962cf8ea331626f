"""Free TCP ports on this machine, for rendezvous and process-group stores (no torch needed)."""

import socket


def free_port() -> int:
    """A TCP port on localhost that nothing is listening on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
