"""The trainer's side of the same-node call lanes. A lane call is bounded by the caller's timeout and fails at
once when the rank's process is gone or the connection breaks: it never hangs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import socket
import time
from typing import Any, Dict, Optional, Sequence

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.lane_wire import FRAME_TIMEOUT_S, ID_BYTES, recv_frame, send_frame
from sglang.srt.ray.rdt.transport import same_node
from sglang.srt.ray.rdt.transport.cma import LIVENESS_CHECK_S, pid_alive

logger = logging.getLogger(__name__)


class RankGone(RuntimeError):
    """The rank's process exited, or its lane broke, while a call waited for it."""


class LaneCall:
    """One request in flight on a rank's lane; :meth:`result` waits for it."""

    def __init__(self, link: "RankLink", req_id: bytes):
        self._link, self._req_id = link, req_id
        self._reply: Any = None
        self._done = False
        self.defines: Optional[int] = None  # the layout this call tells the rank
        self.defines_source = 0  # the kept description this call tells the rank

    def _receive(self, timeout_s: float) -> None:
        if not self._done:
            self._reply = self._link.receive(self._req_id, time.monotonic() + max(0.0, timeout_s))
            self._done = True

    def result(self, timeout_s: float) -> Any:
        self._receive(timeout_s)
        kind, value = self._reply
        if kind == "ok":
            return value
        if kind == "raise":
            raise value
        raise WeightSyncError(f"the rank's call lane refused the call: {value}")

    def finished(self) -> bool:
        """Whether the rank answered (or the call failed)."""
        return self._done

    def wait(self, timeout_s: float) -> None:
        """Wait until the rank answered or the time is up; never raises."""
        try:
            self._receive(timeout_s)
        except TimeoutError:
            pass
        except Exception:
            self._done = True


class RankLink:
    """The trainer's connection to one rank's lane. ``writable``: the rank's parameters are on this process's GPU:
    this process may write them itself, once the rank granted them."""

    def __init__(self, address: str, secret: bytes, pid: int, sender: str, writable: bool = False):
        self.address, self._secret, self.pid = address, secret, int(pid)
        self.writable = writable
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(FRAME_TIMEOUT_S)  # connect, and a frame once started
            self._sock.connect(address)
        except BaseException:
            self._sock.close()
            raise
        self._poll = select.poll()  # (select() fails on descriptors >= 1024)
        self._poll.register(self._sock, select.POLLIN)
        self._next = 0
        self._early: Dict[bytes, Any] = {}  # replies read while waiting for another
        self.broken = False
        self.defined: set = set()  # layout ids this rank knows on this connection
        self.sources: set = set()  # ids of kept descriptions (IpcPart.kept_id) it knows
        try:
            self.send("hello", {"sender": sender, "pid": os.getpid()}).result(FRAME_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def send(self, op: str, kwargs: Dict[str, Any]) -> LaneCall:
        if self.broken:
            raise RankGone(f"the call lane to the rank (pid {self.pid}) broke earlier")
        self._next += 1
        req_id = self._next.to_bytes(ID_BYTES, "little")
        try:
            send_frame(self._sock, self._secret, req_id, pickle.dumps((op, kwargs), protocol=5))
        except OSError as e:
            self.broken = True  # (a frame cut short would garble every later one)
            raise RankGone(f"the call lane to the rank (pid {self.pid}) broke: {e}") from e
        return LaneCall(self, req_id)

    def receive(self, req_id: bytes, deadline: float):
        while req_id not in self._early:
            if self.broken:
                raise RankGone(f"the call lane to the rank (pid {self.pid}) broke during the call")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer on the call lane within the timeout (is the "
                                   f"scheduler of pid {self.pid} stuck?)")
            if self._poll.poll(int(min(left, LIVENESS_CHECK_S) * 1000) + 1):
                why = ""
                try:
                    body = recv_frame(self._sock)
                except socket.timeout:
                    self.broken = True
                    raise RankGone(f"the rank (pid {self.pid}) stalled in the middle of an answer "
                                   f"for over {FRAME_TIMEOUT_S:g} s") from None
                except (OSError, ConnectionError) as e:  # reset, or cut in a frame
                    body, why = None, f" ({type(e).__name__}: {e})"
                if body is None:
                    self.broken = True
                    raise RankGone(f"the rank's process (pid {self.pid}) exited during the call, "
                                   f"or closed its lane (the connection ended{why})")
                self._early[body[:ID_BYTES]] = pickle.loads(body[ID_BYTES:])
            elif not pid_alive(self.pid):
                self.broken = True
                raise RankGone(f"the rank's process (pid {self.pid}) exited during the call")
        return self._early.pop(req_id)

    def close(self) -> None:
        self.broken = True
        self._sock.close()


class Lanes:
    """The client's lanes, one per rank on this process's node."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.opened = False
        self.links: Dict[int, RankLink] = {}

    def open(self, ranks, statuses: Sequence[Dict[str, Any]], call_timeout_s: float,
             device=None, allocating=None) -> None:
        """Open a lane to every rank on this node that can read this process's memory on ``device`` (probed
        once with a few bytes made in ``allocating()``); the others are reached through Ray."""
        if self.opened or not self.enabled:
            return
        self.opened = True
        import ray
        import torch

        here, token = same_node.node_id(), same_node.token()
        kept = allocating is not None and device is not None and device.type == "cuda"
        with allocating() if kept else contextlib.nullcontext():
            probe = torch.arange(256, dtype=torch.uint8, device=device or "cpu")
        if probe.is_cuda:
            torch.cuda.synchronize(probe.device)
        meta = same_node.export([probe])
        calls = [(r, r.actor.open_weight_sync_lane.remote(token, os.getpid(), meta))
                 for r, st in zip(ranks, statuses) if (st.get("ipc_reach") or {}).get("node_id") == here]
        for r, ref in calls:
            try:
                info = ray.get(ref, timeout=call_timeout_s)
                if info.get("unreadable"):
                    logger.warning("[RDT] %s cannot read this process's memory (%s); its pulls go "
                                   "through Ray", r.label(), info["unreadable"])
                elif info.get("node_id") == here:  # (a rank on this GPU: its parameters are written from here)
                    here_gpu = probe.is_cuda and info.get("gpu") == same_node.gpu_uuid(probe.device)
                    self.links[r.index] = RankLink(info["address"], info["secret"], info["pid"], token, here_gpu)
            except Exception as e:
                logger.warning("[RDT] no call lane to %s (%s: %s); its pulls go through Ray",
                               r.label(), type(e).__name__, str(e).splitlines()[0][:200])
        del probe  # (read by now: every rank answered)

    def link(self, rank: int) -> Optional[RankLink]:
        """The lane of ``rank``, if it has a working one."""
        link = self.links.get(rank)
        return None if link is None or link.broken else link

    def pull(self, rank: int, group, meta, timeout: Optional[float], op: str = "pull") -> LaneCall:
        """Send ``rank`` a pull of ``meta`` (``group``'s same-node description). The layout and a kept description
        go along only the first time this lane sees them; later pulls name their ids. ``op="prepare"``: plan and
        map, write nothing; ``op="grant"`` (``meta`` None): the rank answers with its targets for this process to
        write (``"pushed"`` says how that went)."""
        link = self.links[rank]
        first = group.layout not in link.defined
        kept = meta.ipc.kept_id if meta is not None and meta.ipc is not None else 0
        known = kept and kept in link.sources
        call = link.send(op, {
            "layout": group.layout, "names": list(group.names) if first else None,
            "specs": group.specs() if first else None, "timeout": timeout,
            "source": None if known else meta, "source_id": kept})
        call.defines = group.layout if first else None
        call.defines_source = 0 if known else kept
        return call

    def defined(self, rank: int, call: LaneCall) -> None:
        """``call`` (a pull) succeeded: its layout is known on that lane now."""
        link = self.links.get(rank)
        if link is None:
            return
        if call.defines is not None:
            link.defined.add(call.defines)
        if call.defines_source:
            link.sources.add(call.defines_source)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        self.opened = False
