"""The trainer's side of the ranks' same-node call lanes.

Every update after the first sends the ranks refs they have read before: a
zero-copy update its kept ref (the trainer's tensors did not move), a bucket
update the kept refs of its buckets (``BucketSender``). To a rank on this node
such a ``pull_weights`` goes over the rank's lane
(:mod:`sglang.srt.ray.rdt.engine.local_lane`: a Unix socket, ~45 us a round
trip) instead of a Ray actor call (~2.5 ms on an H200 host): the rank runs the
same pull. Everything else — the first pull of a new ref, every other call,
ranks on other nodes — stays a Ray actor call. Which refs a rank holds is
mirrored here by the rank's rule: those read since the end of the previous
update.

A lane call is waited for like an actor call (:func:`sglang.srt.ray.rdt.ranks.gather`
takes both). It cannot hang: it is bounded by the caller's timeout, and it
fails at once when the rank's process is gone. A rank that no longer holds the
ref answers so before doing anything, and the call goes through Ray instead.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any, Callable, Dict, Optional, Sequence

from sglang.srt.ray.rdt.defaults import LANE_NOT_HELD
from sglang.srt.ray.rdt.lane_wire import (
    FRAME_TIMEOUT_S,
    ID_BYTES,
    recv_frame,
    send_frame,
)
from sglang.srt.ray.rdt.errors import WeightSyncError

logger = logging.getLogger(__name__)

# How often a waiting call looks whether the rank's process still exists.
LIVENESS_CHECK_S = 0.25


class RankGone(RuntimeError):
    """The rank's process exited while a lane call waited for it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LaneCall:
    """One request in flight on a rank's lane; :meth:`result` waits for it."""

    def __init__(self, link: "RankLink", req_id: bytes, fallback: Optional[Callable[[], Any]]):
        self._link, self._req_id, self._fallback = link, req_id, fallback
        self._done = False
        self._value: Any = None
        self._ray_ref: Any = None  # the actor call it fell back to

    def result(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._done:
            self._value = self._link.receive(self._req_id, deadline)
            self._done = True
        kind, *rest = self._value
        if kind == "ok":
            return rest[0]
        if kind == "raise":
            raise rest[0]
        why, message = rest
        if why == LANE_NOT_HELD and self._fallback is not None:
            import ray

            if self._ray_ref is None:
                logger.debug("[RDT] %s; through Ray", message)
                self._ray_ref = self._fallback()
            return ray.get(self._ray_ref, timeout=max(0.0, deadline - time.monotonic()))
        raise WeightSyncError(f"the rank's call lane refused the call ({why}): {message}")

    def finished(self) -> bool:
        """Whether the rank answered (and any actor call it fell back to returned)."""
        if not self._done:
            return False
        if self._ray_ref is None:
            return True
        import ray

        return bool(ray.wait([self._ray_ref], timeout=0)[0])

    def wait(self, timeout_s: float) -> None:
        """Wait until the rank answered (or the time is up); never raises and
        never starts the actor call a refused lane call falls back to."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            if not self._done:
                self._value = self._link.receive(self._req_id, deadline)
                self._done = True
        except Exception:
            return
        if self._ray_ref is not None:
            import ray

            ray.wait([self._ray_ref], timeout=max(0.0, deadline - time.monotonic()))


class RankLink:
    """The trainer's connection to one rank's lane."""

    def __init__(self, address: str, secret: bytes, pid: int):
        import select
        import socket

        self.address, self._secret, self.pid = address, secret, int(pid)
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
        # The connection failed: nothing more goes over it (the client then
        # reaches the rank through Ray). Calls already sent may still read
        # their answers — unless the incoming stream itself broke (garbled).
        self.broken = False
        self._garbled = False

    def send(self, op: str, kwargs: Dict[str, Any], fallback: Optional[Callable[[], Any]] = None) -> LaneCall:
        self._next += 1
        req_id = self._next.to_bytes(ID_BYTES, "little")
        try:
            send_frame(self._sock, self._secret, req_id, pickle.dumps((op, kwargs)))
        except OSError:
            self.broken = True  # (a frame cut short would garble every later one)
            raise
        return LaneCall(self, req_id, fallback)

    def receive(self, req_id: bytes, deadline: float):
        while req_id not in self._early:
            if self._garbled or self._sock.fileno() < 0:
                raise RankGone(f"the call lane to the rank (pid {self.pid}) broke during the call")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no answer on the call lane within the timeout (is the scheduler of "
                    f"pid {self.pid} stuck?)")
            if self._poll.poll(int(min(left, LIVENESS_CHECK_S) * 1000) + 1):
                try:
                    body = recv_frame(self._sock)
                except (OSError, ConnectionError) as e:  # reset, stalled or cut in a frame
                    body, why = None, f" ({type(e).__name__}: {e})"
                else:
                    why = ""
                if body is None:
                    self.broken = self._garbled = True
                    raise RankGone(f"the rank's process (pid {self.pid}) exited during the call, "
                                   f"or closed its lane (the connection ended{why})")
                self._early[body[:ID_BYTES]] = pickle.loads(body[ID_BYTES:])
            elif not _pid_alive(self.pid):
                self.broken = True
                raise RankGone(f"the rank's process (pid {self.pid}) exited during the call")
        return self._early.pop(req_id)

    def retire(self) -> None:
        """Send nothing more (the rank drops a request cut short), but let
        calls already sent read their answers."""
        self.broken = True
        try:
            import socket

            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.broken = True
        self._sock.close()


class Lanes:
    """The client's lanes, one per rank on this node, and which ref each rank
    holds (read once through Ray, so a lane call may name it)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.opened = False
        self.links: Dict[int, RankLink] = {}
        self._held: Dict[int, set] = {}  # rank -> hex of the refs it holds
        self._read: Dict[int, set] = {}  # rank -> hex of the refs it read in this update
        self._retired: list = []  # broken links, closed with the lanes

    def open(self, ranks, statuses: Sequence[Dict[str, Any]], call_timeout_s: float) -> None:
        """Open a lane to every rank on this process's node (once). A rank
        that cannot (an engine without lanes) is simply reached through Ray."""
        if self.opened or not self.enabled:
            return
        self.opened = True
        import ray

        from sglang.srt.ray.rdt.transport import sglang_ipc

        here = ray.get_runtime_context().get_node_id()
        token = sglang_ipc.sender_token()
        local = [r for r, st in zip(ranks, statuses)
                 if (st.get("ipc_reach") or {}).get("node_id") == here]
        calls = []
        for r in local:
            try:
                calls.append((r, r.actor.open_weight_sync_lane.remote(token)))
            except AttributeError:  # an engine without lanes: Ray calls only
                logger.info("[RDT] %s has no call lane; pulls go through Ray", r.label())
        for r, ref in calls:
            try:
                info = ray.get(ref, timeout=call_timeout_s)
                if info.get("node_id") == here:
                    self.links[r.index] = RankLink(info["address"], info["secret"], info["pid"])
            except Exception as e:
                logger.warning("[RDT] no call lane to %s (%s: %s); pulls go through Ray",
                               r.label(), type(e).__name__, str(e).splitlines()[0][:200])

    def held(self, rank: int, ref) -> None:
        """``rank`` read ``ref``: it holds it until an update ends that does not read it."""
        if self.links:
            self._held.setdefault(rank, set()).add(ref.hex())
            self._read.setdefault(rank, set()).add(ref.hex())

    def update_ended(self) -> None:
        """The ranks' rule at an update's end: refs the update did not read are let go."""
        self._held = {r: self._read.get(r, set()) & held for r, held in self._held.items()}
        self._read = {}

    def pull(self, rank, ref, names, timeout, extra: Dict[str, Any]):
        """``rank.actor.pull_weights.remote([ref], names, timeout, **extra)``,
        over the lane when the rank holds ``ref``: an ObjectRef or a
        :class:`LaneCall`, both waited for by ``ranks.gather``."""
        def through_ray():
            return rank.actor.pull_weights.remote([ref], names, timeout, **extra)

        link = self.links.get(rank.index)
        if link is not None and link.broken:
            self._drop(rank.index)
            link = None
        if link is None or ref.hex() not in self._held.get(rank.index, ()):
            return through_ray()
        try:
            return link.send("pull_weights", {"ref_ids": [ref.hex()], "names": names,
                                              "timeout": timeout, **extra}, fallback=through_ray)
        except OSError as e:  # nothing of the call reached the rank's pull
            logger.warning("[RDT] the call lane to %s broke (%s: %s); pulls go through Ray",
                           rank.label(), type(e).__name__, e)
            self._drop(rank.index)
            return through_ray()

    def _drop(self, rank: int) -> None:
        """Stop using ``rank``'s lane (its connection failed). Calls already
        sent over it may still read their answers; it is closed with the
        client's lanes."""
        link = self.links.pop(rank, None)
        if link is not None:
            link.retire()
            self._retired.append(link)
        self._held.pop(rank, None)
        self._read.pop(rank, None)

    def forget(self) -> None:
        self._held.clear()
        self._read.clear()

    def close(self) -> None:
        for link in [*self.links.values(), *self._retired]:
            link.close()
        self.links.clear()
        self._retired.clear()
        self.forget()
        self.opened = False
