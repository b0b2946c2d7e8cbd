"""A rank's same-node call lane: ``pull_weights`` without a Ray round trip.

A zero-copy update (``WeightSyncClient`` reading the trainer's own tensors)
is one ``pull_weights`` per rank, and on one H200 its copy takes ~4 ms while
the Ray actor call around it costs ~2.5 ms (dispatch + reply) — a fixed cost
no rank-side work can shrink. A trainer on the rank's node can instead send
the call over this lane: a Unix stream socket, served by one thread of the
rank's process that blocks in its read (no broker or I/O thread between the
two: a round trip is one wake-up each way, ~45 us on a 2-core box against
~100 us through a ZeroMQ socket pair). The call it carries is the rank core's own
:meth:`RankWeightSync.pull` — the same safe-point hop, quiescence check,
plan, transfer and bookkeeping as the actor method; the lane only replaces
how the request arrives and how the answer goes back.

Refs cannot travel over it (Ray attaches an RDT ref's metadata when it hands
the ref to an actor method), so a lane call names refs the rank already
holds: after a trainer opened a lane (:meth:`RankLane.open`, an actor call
that returns the address and a secret), the rank keeps the refs of that
trainer's same-node reads (``pull_weights``, over Ray or the lane, and
``prepare_pull_weights``) — those read since the end of the previous update;
at each update's end it lets go of every ref the update did not read, and
``release_weight_sync_mappings(sender)`` and the rank's shutdown drop them
all. A kept ref holds the trainer's memory alive (its own kept ref does too,
``trainer/direct.py``; bucket refs are views of buffers it keeps anyway), so
memory the trainer stopped sending is held at most one update longer.

Who may call: the socket lives in a fresh 0700 directory (same user only),
and every request carries the lane's 16-byte secret, checked before the
request is unpickled. The secret is handed out only by the actor call, which
Ray's token authentication guards.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import secrets
import selectors
import shutil
import socket
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence

from sglang.srt.ray.rdt.defaults import LANE_NOT_HELD
from sglang.srt.ray.rdt.lane_wire import (
    FRAME_TIMEOUT_S,
    ID_BYTES,
    SECRET_BYTES,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

# Requests a lane serves (the rank core's methods it calls).
OPS = ("pull_weights", "ping")
# How often the serving thread looks whether the lane was closed.
POLL_MS = 200
# A lane's socket directory: DIR_PREFIX + "<pid>-<random>" in the temp dir.
DIR_PREFIX = "sglang-rdt-lane-"
# Refs a rank holds per trainer process at most (a model's buckets, or one
# zero-copy ref per update).
MAX_HELD_PER_SENDER = 256


def remove_dead_lanes(base: str) -> int:
    """Remove the lane directories under ``base`` of this user's processes
    that are gone (a killed rank cannot remove its own). Returns how many."""
    import glob

    n = 0
    for path in glob.glob(os.path.join(base, DIR_PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(DIR_PREFIX):].split("-", 1)[0])
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            n += 1
        except (ValueError, OSError):
            continue  # not ours, or the process lives (or we may not tell)
    return n


class RefNotHeld(Exception):
    """A lane call named a ref this rank does not hold."""


class RankLane:
    """The lane of one rank: the socket, its thread, and the refs it may name."""

    def __init__(self, pull, after_reply=None):
        # What a lane call runs: RankWeightSync.pull(refs, names, timeout, finalize).
        self._pull = pull
        # Run once each answer has been sent (work nobody should wait for).
        self._after_reply = after_reply
        self._lock = threading.Lock()
        self._senders: set = set()  # trainer processes that opened the lane
        self._held: Dict[str, Dict[str, Any]] = {}  # sender -> {ref hex: ref}
        self._read: Dict[str, set] = {}  # sender -> hex of the refs read since the last update end
        self._secret = secrets.token_bytes(16)
        self._dir: Optional[str] = None
        self._address: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.calls = 0

    # -- the actor side ------------------------------------------------------ #
    def open(self, sender: str) -> Dict[str, Any]:
        """Start serving (once) and keep ``sender``'s same-node refs from now
        on. Returns what the trainer connects with."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the rank's lane is closed")
            if self._thread is None:
                self._start()
            self._senders.add(str(sender))
        return {"address": self._address, "secret": self._secret, "pid": os.getpid()}

    def _start(self) -> None:
        import atexit

        base = tempfile.gettempdir()
        if len(base) > 60:  # a Unix socket path must stay under ~107 bytes
            base = "/tmp"
        remove_dead_lanes(base)
        # mode 0700; named by pid, so a later rank can remove it if this
        # process dies without closing its lane (killed actors do)
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, self._dir, True)
        self._address = os.path.join(self._dir, "lane")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._address)
        listener.listen(16)
        self._thread = threading.Thread(target=self._serve, args=(listener,), name="rdt-lane",
                                        daemon=True)
        self._thread.start()

    def keep(self, refs: Sequence[Any]) -> None:
        """After a read (pull or prepare): keep the same-node refs of a sender
        that opened a lane, until the end of an update that did not read them."""
        if not self._senders:
            return
        from sglang.srt.ray.rdt.engine.refs import same_node_sender

        kept = [(sender, ref) for ref in refs
                if (sender := same_node_sender(ref)) is not None and sender in self._senders]
        if not kept:
            return
        with self._lock:
            for sender, ref in kept:
                held = self._held.setdefault(sender, {})
                if len(held) >= MAX_HELD_PER_SENDER and ref.hex() not in held:
                    held.pop(next(iter(held)))  # the oldest
                held[ref.hex()] = ref
                self._read.setdefault(sender, set()).add(ref.hex())

    def end_of_update(self) -> None:
        """An update ended: let go of the refs it did not read."""
        with self._lock:
            for sender, held in self._held.items():
                read = self._read.get(sender, set())
                self._held[sender] = {h: r for h, r in held.items() if h in read}
            self._read.clear()

    def release(self, sender: Optional[str] = None) -> int:
        """Drop the refs held for ``sender`` (every sender: None)."""
        with self._lock:
            if sender is None:
                n = sum(len(h) for h in self._held.values())
                self._held.clear()
                self._read.clear()
            else:
                n = len(self._held.pop(str(sender), {}))
                self._read.pop(str(sender), None)
        return n

    def resolve(self, ref_ids: Sequence[str]) -> List[Any]:
        with self._lock:
            out = []
            for rid in ref_ids:
                ref = next((h[rid] for h in self._held.values() if rid in h), None)
                if ref is None:
                    raise RefNotHeld(
                        f"ref {rid[:16]} is not held by this rank (never pulled here through "
                        "pull_weights, or released since): send the pull as an actor call")
                out.append(ref)
            return out

    def status(self) -> Dict[str, Any]:
        with self._lock:
            return {"open": (self._thread is not None and self._thread.is_alive()
                             and not self._stop.is_set()),
                    "senders": len(self._senders),
                    "held_refs": sum(len(h) for h in self._held.values()),
                    "calls": self.calls}

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_MS / 1000 + 1)
        self.release()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- the serving thread --------------------------------------------------- #
    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(POLL_MS / 1000):
                    if key.fileobj is listener:
                        conn, _ = listener.accept()
                        conn.settimeout(FRAME_TIMEOUT_S)  # a started frame must finish
                        sel.register(conn, selectors.EVENT_READ)
                    elif not self._serve_one(key.fileobj):
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
        except Exception:  # pragma: no cover - the lane dies, Ray calls still work
            logger.exception("[RDT] the weight-sync lane stopped")
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one request of ``conn``; False when the trainer went away."""
        try:
            body = recv_frame(conn)
        except (OSError, ConnectionError):
            return False
        if body is None or len(body) < SECRET_BYTES + ID_BYTES:
            return False  # closed, or not one of ours
        secret, req_id = body[:SECRET_BYTES], body[SECRET_BYTES:SECRET_BYTES + ID_BYTES]
        if not hmac.compare_digest(secret, self._secret):
            reply = ("error", "denied", "wrong lane secret")  # nothing was unpickled
        else:
            reply = self._handle(body[SECRET_BYTES + ID_BYTES:])
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # an unpicklable result or exception
            data = pickle.dumps(("error", "other", f"{type(e).__name__}: {e}"))
        try:
            send_frame(conn, req_id, data)
        except OSError:
            return False
        if self._after_reply is not None:
            try:
                self._after_reply()
            except Exception:  # pragma: no cover - the answer is out already
                logger.exception("[RDT] lane: work after an answer failed")
        return True

    def _handle(self, payload: bytes):
        try:
            op, kwargs = pickle.loads(payload)
            if op not in OPS:
                return ("error", "other", f"unknown lane op {op!r}")
            self.calls += 1
            if op == "ping":
                return ("ok", {"pid": os.getpid()})
            refs = self.resolve(kwargs["ref_ids"])
            return ("ok", self._pull(refs, kwargs["names"], kwargs.get("timeout"),
                                     kwargs.get("finalize")))
        except RefNotHeld as e:
            return ("error", LANE_NOT_HELD, str(e))
        except BaseException as e:
            return ("raise", e)
