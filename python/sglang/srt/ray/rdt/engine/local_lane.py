"""A rank's same-node call lane: a trainer on its node sends pulls, grants, finalize and abort over a Unix socket.

Requests run the core's own calls. A layout (names, shapes, dtypes) and a description of kept memory are sent
once per connection, then named by id. A trainer on the rank's own device asks for a *grant* instead of a pull (the
checks of a pull, then the parameters described for it), writes them itself and says how that went (``pushed``).

Threads: one serves the socket (reads every request, answers all but pulls and grants); each of those goes to one of
:data:`PULL_WORKERS` threads that waits for the scheduler to run it and answers it, so the next pull is queued
while this one copies. Anything else on a connection, and its end, first waits (bounded) for its pulls.

Who may call: the socket lives in a fresh 0700 directory, and every request carries the lane's secret, checked
before anything is unpickled; only the actor call ``open_weight_sync_lane`` hands it out. The trainer process
that asked is the writer of every pull on its connection.
"""

from __future__ import annotations

import atexit
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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Dict, List, Optional

from sglang.srt.ray.rdt.defaults import PULL_WAIT_MARGIN_S, PULL_TIMEOUT_S
from sglang.srt.ray.rdt.engine.plan import TensorSpec
from sglang.srt.ray.rdt.engine.sources import LocalSource
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.lane_wire import FRAME_TIMEOUT_S, ID_BYTES, SECRET_BYTES, recv_frame, send_frame
from sglang.srt.ray.rdt.transport.cma import pid_alive

logger = logging.getLogger(__name__)

# How often the serving thread looks whether the lane was closed.
POLL_MS = 200
# A lane's socket directory: DIR_PREFIX + "<pid>-<random>" in the temp dir.
DIR_PREFIX = "sglang-rdt-lane-"
# Layouts one connection may define (a model's groups, each update the same).
MAX_LAYOUTS = 4096
# Threads that wait for pulls (two keep the scheduler's next pull queued).
PULL_WORKERS = 2


def remove_dead_lanes(base: str) -> int:
    """Remove this user's lane directories under ``base`` whose process is gone. Returns how many."""
    import glob

    n = 0
    for path in glob.glob(os.path.join(base, DIR_PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(DIR_PREFIX):].split("-", 1)[0])
            # (an exited process not yet reaped counts as gone)
            if os.stat(path).st_uid != os.getuid() or pid_alive(pid):
                continue  # not ours, or the process lives
        except (ValueError, OSError):
            continue  # not ours, or we may not tell
        shutil.rmtree(path, ignore_errors=True)
        n += 1
    return n


class _Connection:
    """One trainer's connection: who it is, the layouts it defined, its pulls in flight."""

    def __init__(self):
        self.writer: Optional[Writer] = None
        self.layouts: Dict[int, tuple] = {}  # id -> (names, specs, plan key)
        self.sources: Dict[int, Any] = {}  # kept description id -> its description
        self.pulls: List[Future] = []  # answered by a worker once done (serving thread only)
        self.send_lock = threading.Lock()  # guards writing answers to the socket

    def settle(self) -> None:
        """Wait (bounded) for the pulls in flight: what comes next is ordered after them."""
        futures_wait(self.pulls, timeout=PULL_TIMEOUT_S + PULL_WAIT_MARGIN_S)
        self.pulls = [f for f in self.pulls if not f.done()]
        if self.pulls:
            logger.error("[RDT] lane: %d pulls still run after their bound", len(self.pulls))


class RankLane:
    """The lane of one rank: the socket, its thread, the requests it serves."""

    def __init__(self, rank, after_reply=None):
        self._rank = rank  # the RankWeightSync whose methods requests call
        self._after_reply = after_reply  # run once each answer has been sent
        # Guards _senders and the start/stop of the serving thread.
        self._lock = threading.Lock()
        self._senders: Dict[str, int] = {}  # trainer processes that opened the lane -> pid
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._dir: Optional[str] = None
        self._address: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._defined = 0  # layouts defined on any connection (serving thread only)
        self.calls = 0
        # Pulls wait for the scheduler here while the serving thread reads the next request.
        self._workers = ThreadPoolExecutor(max_workers=PULL_WORKERS, thread_name_prefix="rdt-lane-pull")

    def open(self, sender: str, pid: int = 0) -> Dict[str, Any]:
        """Start serving (once) and admit trainer process ``sender``."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the rank's lane is closed")
            if self._thread is None:
                self._start()
            self._senders[str(sender)] = int(pid)
        return {"address": self._address, "secret": self._secret, "pid": os.getpid()}

    def _start(self) -> None:
        base = tempfile.gettempdir()
        if len(base) > 60:  # a Unix socket path must stay under ~107 bytes
            base = "/tmp"
        remove_dead_lanes(base)
        # mode 0700; named by pid, so a later rank removes it if this process dies without closing it
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, self._dir, True)
        self._address = os.path.join(self._dir, "lane")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._address)
        listener.listen(16)
        self._thread = threading.Thread(target=self._serve, args=(listener,), name="rdt-lane", daemon=True)
        self._thread.start()

    def status(self) -> Dict[str, Any]:
        with self._lock:
            return {"open": self._thread is not None and self._thread.is_alive() and not self._stop.is_set(),
                    "senders": len(self._senders), "calls": self.calls}

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_MS / 1000 + 1)
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(POLL_MS / 1000):
                    if key.fileobj is listener:
                        conn, _ = listener.accept()
                        conn.settimeout(FRAME_TIMEOUT_S)  # a started frame must finish
                        sel.register(conn, selectors.EVENT_READ, _Connection())
                    elif not self._serve_one(key.fileobj, key.data):
                        sel.unregister(key.fileobj)
                        key.data.settle()  # (its last answers may find the socket closed)
                        key.fileobj.close()
                        writer = key.data.writer
                        if (writer is not None and not self._stop.is_set()
                                and not any(getattr(k.data, "writer", None) == writer
                                            for k in sel.get_map().values())):
                            # (its last connection: the process went away)
                            self._rank.writer_gone(writer, "closed its lane")
        except Exception:  # pragma: no cover - the lane dies, Ray calls still work
            logger.exception("[RDT] the weight-sync lane stopped")
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()

    def _serve_one(self, sock: socket.socket, conn: _Connection) -> bool:
        """Answer one request; False when the trainer went away."""
        try:
            body = recv_frame(sock)
        except (OSError, ConnectionError):
            return False
        received = time.perf_counter()
        if body is None or len(body) < SECRET_BYTES + ID_BYTES:
            return False  # closed, or not one of ours
        secret, req_id = body[:SECRET_BYTES], body[SECRET_BYTES:SECRET_BYTES + ID_BYTES]
        if not hmac.compare_digest(secret, self._secret):
            reply = ("error", "wrong lane secret")  # nothing was unpickled
        else:
            reply = self._handle(conn, body[SECRET_BYTES + ID_BYTES:])
        if callable(reply):  # a pull: a worker answers it once done
            conn.pulls = [f for f in conn.pulls if not f.done()]
            conn.pulls.append(self._workers.submit(self._answer_later, sock, conn, req_id, reply, received))
            return True
        return self._answer(sock, conn, req_id, reply)

    def _answer_later(self, sock, conn: _Connection, req_id: bytes, pull, received: float) -> None:
        picked = time.perf_counter()
        try:
            out = pull()
            if isinstance(out.get("timing"), dict):  # (where the way to the scheduler went)
                out["timing"].update(lane_received=received, lane_picked=picked)
            reply = ("ok", out)
        except BaseException as e:
            reply = ("raise", e)
        if not self._answer(sock, conn, req_id, reply):
            try:  # (a frame may be cut short): the serving thread sees the end and cleans up
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answer(self, sock, conn: _Connection, req_id: bytes, reply) -> bool:
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # an unpicklable result or exception
            data = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
        try:
            with conn.send_lock:
                send_frame(sock, req_id, data)
        except OSError:
            return False
        if self._after_reply is not None:
            try:
                self._after_reply()
            except Exception:  # pragma: no cover - the answer is out already
                logger.exception("[RDT] lane: work after an answer failed")
        return True

    def _handle(self, conn: _Connection, payload: bytes):
        """The answer to a request, or (a pull) what a worker runs to answer it."""
        try:
            op, kw = pickle.loads(payload)
            self.calls += 1
            if op not in ("pull", "grant"):
                conn.settle()  # ordered after the pulls sent before it
            if op == "hello":
                sender = str(kw["sender"])
                with self._lock:
                    pid = self._senders.get(sender)
                if pid is None:
                    return ("error", "this trainer process did not open the lane (open_weight_sync_lane)")
                conn.writer = Writer(f"process:{sender}", f"trainer process {pid} (same-node lane)")
                return ("ok", {"pid": os.getpid()})
            if conn.writer is None:
                return ("error", "say hello first")
            if op in ("pull", "grant"):
                return self._pull(conn, op, kw)
            if op == "pushed":  # (ordered after the grant: settled above); the figures are the trainer's
                stats = {**{k: kw.get(k, 0) for k in ("tensors", "bytes", "seconds")}, "transports": [kw["transport"]]}
                self._rank.state.confirmed(int(kw["grant"]), conn.writer, str(kw["outcome"]), stats)
                return ("ok", {**stats, "outcome": kw["outcome"], "transport": kw["transport"]})
            if op == "prepare":
                return ("ok", self._pull(conn, op, kw))
            if op == "finalize":
                # (the next update's walk runs once this answer has left: after_reply)
                return ("ok", self._rank.finalize(kw.get("weight_version"), kw.get("flush_cache", True),
                                                  walk_after=False))
            if op == "abort":
                return ("ok", self._rank.abort(kw.get("reason", "aborted")))
            return ("error", f"unknown lane op {op!r}")
        except BaseException as e:
            return ("raise", e)

    def _pull(self, conn: _Connection, op: str, kw: Dict[str, Any]):
        layout_id = int(kw["layout"])
        if kw.get("names") is not None:  # the layout's definition, once per connection
            if len(conn.layouts) >= MAX_LAYOUTS and layout_id not in conn.layouts:
                conn.layouts.clear()
            names, specs = list(kw["names"]), [TensorSpec.of(e) for e in kw["specs"]]
            if len(names) != len(specs) or not all(type(n) is str for n in names):
                raise WeightSyncError(f"layout {layout_id}: {len(names)} names for {len(specs)} "
                                      "tensors, or a name that is not a string")
            self._defined += 1  # the plan's key: unique per definition
            conn.layouts[layout_id] = (names, specs, ("lane", self._defined))
        if layout_id not in conn.layouts:
            raise KeyError(f"layout {layout_id} was never defined on this connection")
        names, specs, key = conn.layouts[layout_id]
        meta, source_id = kw.get("source"), int(kw.get("source_id") or 0)
        if op == "grant":  # the trainer writes the targets itself: nothing of it is read
            return lambda: self._rank.pull_sources([LocalSource(None, conn.writer, specs)], [names],
                                                   kw.get("timeout"), key, grant=True)
        if meta is None:  # a description of kept memory sent before
            if source_id not in conn.sources:
                raise KeyError(f"source {source_id} was never sent on this connection")
            meta = conn.sources[source_id]
        elif source_id:
            if len(conn.sources) >= MAX_LAYOUTS and source_id not in conn.sources:
                conn.sources.clear()
            conn.sources[source_id] = meta
        source = LocalSource(meta, conn.writer, specs)
        if op == "prepare":
            return self._rank.prepare_sources([source], [names], key)
        return lambda: self._rank.pull_sources([source], [names], kw.get("timeout"), key)
