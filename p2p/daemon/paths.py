"""Which paths a local-API caller may have the daemon read (``put``), and what kind of file
it reads: decisions on explicit arguments, each raising ``ApiError`` with its reason.

Rules
1. The Unix socket: the caller's uid, from the socket's peer credentials (``SO_PEERCRED``),
   must be the daemon's own (or root's, which could read the file itself): the daemon then
   opens only what its caller could open. Any other caller is ``forbidden``: a socket
   whose mode was widened does not make the daemon read for other users.
2. TCP: a path only under a directory the operator listed (``serve --api-put-dir DIR``),
   none by default, judged after ``..`` and symbolic links are resolved; links inside a
   directory put are not followed. Whoever holds the token (maybe from another machine,
   with ``--api-allow-remote``) never makes the daemon read its key, its token or anything
   else of its user's.
3. Either way only regular files and directories are read: a FIFO, socket or device is
   refused from its ``stat``, before anything opens it, so a put never waits on a writer
   that never comes (or rewinds a tape). A file swapped for a FIFO between that check and
   the read holds one user-path thread (p2p.daemon.server rule 5), no more.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from p2p.daemon import api

# struct ucred: pid, uid, gid (Linux).
_UCRED = struct.Struct("3i")


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of Unix socket ``sock`` (a stdlib or trio
    socket); None where the platform does not say (then rule 1 refuses)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    except OSError:
        return None
    return int(uid)


def check_caller(uid: int | None, daemon_uid: int) -> None:
    """Rule 1."""
    if uid is None or uid not in (daemon_uid, 0):
        raise api.ApiError(
            "forbidden",
            f"this daemon (uid {daemon_uid}) reads files only for its own user, not uid "
            f"{uid}; put the file without it (blob put on a store of your own)",
            api.EXIT_LOCAL_IO,
        )


def check_under(path: str, put_dirs: tuple[Path, ...]) -> Path:
    """Rule 2: ``path`` resolved, when it lies under one of ``put_dirs``."""
    if not put_dirs:
        raise api.ApiError(
            "forbidden",
            "this daemon's TCP API reads no paths (the operator lists where it may with "
            "serve --api-put-dir DIR)",
            api.EXIT_LOCAL_IO,
        )
    resolved = Path(os.path.realpath(path))
    for root in put_dirs:
        if resolved == root or resolved.is_relative_to(root):
            return resolved
    raise api.ApiError(
        "forbidden",
        f"{path} is not under a directory this daemon's TCP API reads from (serve --api-put-dir)",
        api.EXIT_LOCAL_IO,
    )


def check_kind(path: Path) -> bool:
    """Rule 3: whether ``path`` (links followed, as a put of one file follows them) is a
    directory (True) or a regular file (False); a missing path is left to the store, which
    says so. Anything else is the store's StoreError (exit 5), as a direct put says it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode):
        return True
    if stat.S_ISREG(st.st_mode):
        return False
    from blobstore.errors import StoreError  # the store's own refusal, as a direct put's

    raise StoreError(
        f"{path} is not a regular file or a directory (a FIFO, socket or device); nothing was read"
    )
