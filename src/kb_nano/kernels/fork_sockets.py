"""The fork servers' listening sockets: Linux abstract unix sockets, which the candidate's
Landlock sandbox cannot connect to."""

from __future__ import annotations


def use_abstract_unix_sockets() -> None:
    """Make ``multiprocessing`` listen on Linux *abstract* unix sockets (the fork servers
    that start judges and workers). A fork server unpickles whatever a client sends, and a
    filesystem socket can be connected to from inside the candidate's Landlock sandbox;
    an abstract socket created outside it cannot (Landlock scopes abstract unix sockets
    from ABI 6). Call before any fork server starts; idempotent; Linux only."""
    import secrets
    import sys
    from multiprocessing import connection

    if sys.platform != "linux" or getattr(connection.arbitrary_address, "_kb_nano", False):
        return
    original = connection.arbitrary_address

    def arbitrary_address(family):
        if family == "AF_UNIX":
            return "\0kb_nano-" + secrets.token_hex(16)
        return original(family)

    arbitrary_address._kb_nano = True
    connection.arbitrary_address = arbitrary_address
