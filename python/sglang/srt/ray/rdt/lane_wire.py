"""The call lane's wire format, shared by the rank (``engine/local_lane.py``)
and the trainer (``trainer/lane.py``).

A frame is a 4-byte little-endian length and its body. A request's body is
the lane's 16-byte secret, an 8-byte request id and the pickled ``(op,
kwargs)``; an answer's body the request id and the pickled answer. The secret
comes first so the rank can refuse a request before unpickling anything.
"""

from __future__ import annotations

import socket
import struct
from typing import Optional

FRAME = struct.Struct("<I")
SECRET_BYTES, ID_BYTES = 16, 8
MAX_FRAME = 64 << 20  # a request names refs and parameters; more is not one of ours
# How long the rest of a frame may take once its first bytes arrived.
FRAME_TIMEOUT_S = 10.0


def send_frame(sock: socket.socket, *parts: bytes) -> None:
    body = b"".join(parts)
    sock.sendall(FRAME.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> Optional[bytes]:
    """One whole frame, or None when the peer closed the connection."""
    head = _recv_exact(sock, FRAME.size)
    if head is None:
        return None
    (n,) = FRAME.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"a {n}-byte frame on the call lane (at most {MAX_FRAME})")
    body = _recv_exact(sock, n) if n else b""
    if body is None:
        raise ConnectionError("the call lane closed in the middle of a frame")
    return body


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    """``n`` bytes; None if the peer closed before the first one."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ConnectionError("the call lane closed in the middle of a frame")
            return None
        buf += chunk
    return bytes(buf)
