"""Loaded by every Python process of the network test (PYTHONPATH): records each attempt to reach a
host other than this machine (name lookups, connects, sends) into $GLMCORE_NETLOG."""
import os
import sys

_LOCAL = {None, "", "localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _host(addr):
    if isinstance(addr, tuple) and addr:
        return addr[0]
    return None if isinstance(addr, (str, bytes)) else addr     # AF_UNIX paths are local


def _hook(event, args):
    if event == "socket.getaddrinfo":
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
    elif event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        host = _host(args[1]) if len(args) > 1 else None
    else:
        return
    if host in _LOCAL or (isinstance(host, str) and host.startswith("127.")):
        return
    with open(os.environ["GLMCORE_NETLOG"], "a") as f:
        f.write(f"{os.getpid()} {event} {host!r} {sys.argv[:3]}\n")


sys.addaudithook(_hook)
