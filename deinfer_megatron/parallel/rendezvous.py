"""How the ranks of a job find each other, and what that exposes on the network.

torch's default ``env://`` rendezvous makes rank 0 listen on *every* interface of the machine
(an unauthenticated TCP store), even when ``MASTER_ADDR`` is 127.0.0.1. For a job whose master
address is a loopback address — every job the project starts itself — rank 0 here binds the
store's socket to that address and hands it to ``TCPStore`` (``master_listen_fd``), so nothing
listens beyond this machine. Jobs with a real master address (several nodes) keep torch's
behaviour: the store listens on all interfaces of the first node, on ``MASTER_PORT``; under
torchrun the agent's own store is used, as torchrun makes it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist


def _loopback(addr: str) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def local_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of a loopback job, bound to loopback; None otherwise (``env://``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # torchrun's agent already runs the store; join it through env://
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if not _loopback(addr):
        return None
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout=timeout)
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(sockaddr)
    except OSError as err:
        listener.close()
        raise RuntimeError(f"cannot listen on {addr}:{port} for the ranks' rendezvous ({err}); "
                           "choose another MASTER_PORT") from None
    listener.listen(max(64, world))
    # The store takes the descriptor over (and closes it when it shuts down).
    return dist.TCPStore(addr, port, world, True, timeout=timeout, master_listen_fd=listener.detach())
