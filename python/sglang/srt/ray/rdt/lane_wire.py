"""The call lane's wire format, both sides. A frame: a 4-byte little-endian length and its body. A request's body:
the lane's 16-byte secret (first, so a request is refused before anything is unpickled), an 8-byte request id and
the pickled ``(op, kwargs)``; an answer's: the request id and the pickled answer.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Optional

FRAME = struct.Struct("<I")
SECRET_BYTES, ID_BYTES = 16, 8
MAX_FRAME = 64 << 20  # a request names refs and parameters; more is not one of ours
# How long the rest of a frame may take once its first bytes arrived.
FRAME_TIMEOUT_S = 10.0


def send_frame(sock: socket.socket, *parts: bytes) -> None:
    body = b"".join(parts)
    sock.sendall(FRAME.pack(len(body)) + body)


def recv_frame(sock: socket.socket, timeout_s: Optional[float] = None) -> Optional[bytes]:
    """One whole frame, or None if the peer closed before it. The frame must arrive within ``timeout_s``
    (default :data:`FRAME_TIMEOUT_S`; else ``socket.timeout``): a peer stalling mid-frame cannot hold the reader."""
    deadline = time.monotonic() + (FRAME_TIMEOUT_S if timeout_s is None else timeout_s)
    head = _recv_exact(sock, FRAME.size, deadline)
    if head is None:
        return None
    (n,) = FRAME.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"a {n}-byte frame on the call lane (at most {MAX_FRAME})")
    body = _recv_exact(sock, n, deadline)
    if body is None:
        raise ConnectionError("the call lane closed in the middle of a frame")
    return body


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> Optional[bytes]:
    """``n`` bytes by ``deadline`` (monotonic); None if the peer closed before the first one."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    old = sock.gettimeout()
    try:
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("a frame on the call lane did not arrive in time")
            sock.settimeout(left)
            k = sock.recv_into(view[got:])
            if not k:
                if got:
                    raise ConnectionError("the call lane closed in the middle of a frame")
                return None
            got += k
    finally:
        sock.settimeout(old)
    return bytes(buf)
