"""Plain Ray actors around the receiver and a trainer, for tests and demos.

``ToyRank`` holds a small torch model and an :class:`RdtWeightReceiver`, exactly
as a SchedulerActor does, without sglang around it. ``ToyTrainer`` puts buckets
over NIXL (or ``SGLANG_IPC``, the same-node path) and keeps them alive until
told to drop them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Dict, List, Optional

import ray
import torch


def checksum(tensors: Dict[str, torch.Tensor]) -> Dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in sorted(tensors.items())
    }


def process_gone(pid: int) -> bool:
    """True once process ``pid`` (on this host) has exited: no longer listed,
    or a zombie waiting to be reaped (it runs no code and holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X")


def actor_is_dead(actor, pid: Optional[int] = None) -> bool:
    """True once ``actor`` is really dead after ``ray.kill``: Ray answers a
    call on it with ActorDiedError and, if its ``pid`` is given, the process is
    gone. ``ray.kill`` returns before either holds."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
        return False  # still serving calls
    except ray.exceptions.ActorDiedError:
        pass
    except ray.exceptions.GetTimeoutError:
        return False
    return pid is None or process_gone(pid)


def toy_model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)
    )


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class ToyRank:
    def __init__(self, seed: int = 0, width: int = 64, pull_timeout_s: float = 30.0):
        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()  # as the SchedulerActor does
        self.receiver = None
        self.reset(seed, width, pull_timeout_s)

    def set_env(self, key: str, value):
        import os

        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
        return True

    def reset(self, seed: int = 0, width: int = 64, pull_timeout_s: float = 30.0, model=None):
        """A fresh model and receiver (importing sglang once per actor is slow)."""
        from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver

        if self.receiver is not None:
            self.receiver.close()
        self.model = model if model is not None else toy_model(seed, width)
        self.receiver = RdtWeightReceiver(
            lambda: dict(self.model.named_parameters()), pull_timeout_s=pull_timeout_s
        )
        return True

    def reset_big(self, n: int, numel: int, pull_timeout_s: float = 20.0):
        model = torch.nn.ParameterDict(
            {f"w{i}": torch.nn.Parameter(torch.zeros(numel)) for i in range(n)}
        )
        return self.reset(pull_timeout_s=pull_timeout_s, model=model)

    def register(self):
        return self.receiver.register()

    def deregister(self):
        return self.receiver.deregister()

    def set_reader_max_kept(self, n: int):
        from sglang.srt.ray.rdt.transport import nixl_reader

        old, nixl_reader.reader().max_kept = nixl_reader.reader().max_kept, n
        return old

    def pull(self, refs, names, timeout_s=None):
        return self.receiver.pull(refs, names, timeout_s)

    def state(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def checksums(self):
        return checksum(dict(self.model.named_parameters()))

    def pointers(self):
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}

    def status(self):
        return self.receiver.status()

    def reallocate(self, name: str):
        """Give parameter ``name`` new storage (as post-load processing may)."""
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.clone()
        return p.data_ptr()

    def registered_ptrs(self):
        book = self.receiver._registration.book
        return sorted(k[1] for k in book._entries) if book is not None else []

    def make_noncontiguous(self, name: str):
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.t().contiguous().t()
        return p.is_contiguous()

    def pull_with_targets_dropped(self, refs, names):
        """Simulate Ray losing the (weakly held) targets: it then fetches into
        buffers of its own. The receiver must notice and fail loudly. (Reads
        go through ray.get here: SGLANG_RDT_DIRECT_FETCH=0; a direct read
        has no weak references to lose.)"""
        import ray.experimental as rx

        real = rx.set_target_for_ref
        rx.set_target_for_ref = lambda ref, targets: None
        os.environ["SGLANG_RDT_DIRECT_FETCH"] = "0"
        try:
            return self.receiver.pull(refs, names)
        finally:
            rx.set_target_for_ref = real
            del os.environ["SGLANG_RDT_DIRECT_FETCH"]

    def finalize(self):
        """End the update as the rank core does (state, then the receiver)."""
        self.receiver.state.end()
        self.receiver.end_of_update()
        return self.receiver.status()

    def gc_enabled(self) -> bool:
        import gc

        return gc.isenabled()

    def arm_sender_kill(self, pid: int, timeout_s: float = 120.0):
        """Start a thread that SIGKILLs process ``pid`` (a sender on this host)
        as soon as a pull into this rank's parameters is part-way done.

        It samples the first, middle and last element of every parameter and
        compares them with their values now; "part-way" is some samples
        changed and others not yet. So every sample must change in the coming
        pull (``reset_big``'s zeros vs ``ToyTrainer.put_large``'s ``i + 1``).
        Returns once the thread watches; :meth:`disarm_sender_kill` stops it
        and tells what it did.
        """
        import numpy as np

        self.disarm_sender_kill()
        arrays = [p.detach().reshape(-1).numpy() for p in self.model.parameters()]
        idx = [np.unique([0, a.size // 2, a.size - 1]) for a in arrays]
        old = [a[i].copy() for a, i in zip(arrays, idx)]
        total = sum(len(i) for i in idx)
        assert all(a.size for a in arrays) and total

        def changed() -> int:
            return sum(int(np.count_nonzero(a[i] != o)) for a, i, o in zip(arrays, idx, old))

        record = {"killed": False, "samples": total, "outcome": None}
        stop = threading.Event()

        def watch():
            deadline = time.monotonic() + timeout_s
            scans = 0
            while not stop.is_set() and time.monotonic() < deadline:
                scans += 1
                k = changed()
                if k == total:
                    record["outcome"] = "the pull completed before a part-way state was seen"
                    break
                if k:
                    os.kill(pid, signal.SIGKILL)
                    record.update(
                        killed=True, t_kill=time.monotonic(), changed_at_kill=k,
                        # < samples: the transfer was still running after the
                        # signal was sent
                        changed_after_kill=changed(),
                        outcome="killed the sender part-way",
                    )
                    break
                time.sleep(0.0005)  # a poll interval; lets the pull's threads run
            else:
                record["outcome"] = "disarmed" if stop.is_set() else "timed out"
            record["scans"] = scans

        thread = threading.Thread(target=watch, name="sender-killer", daemon=True)
        self._killer = (thread, stop, record)
        thread.start()
        return True

    def disarm_sender_kill(self):
        thread, stop, record = getattr(self, "_killer", None) or (None, None, None)
        if thread is None:
            return None
        stop.set()
        thread.join()
        self._killer = None
        return record


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class ToyTrainer:
    def __init__(self, transport: str = "nixl"):
        # What a trainer that puts with NIXL itself does once (docs): keep the
        # NIXL progress thread of this process from spinning a core.
        from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread

        configure_nixl_progress_thread()
        self.buckets: List[List[torch.Tensor]] = []
        self.transport = transport
        if transport == "SGLANG_IPC":
            from sglang.srt.ray.rdt.transport import sglang_ipc

            sglang_ipc.register()

    def put(self, tensors: List[torch.Tensor]):
        self.buckets.append(tensors)
        return [ray.put(tensors, _tensor_transport=self.transport)]

    def put_plain(self, tensors: List[torch.Tensor]):
        return [ray.put(tensors)]

    def put_large(self, n: int, numel: int):
        ts = [torch.full((numel,), float(i + 1)) for i in range(n)]
        self.buckets.append(ts)
        return [ray.put(ts, _tensor_transport=self.transport)]

    def drop(self):
        self.buckets.clear()

    def mutate(self, value: float):
        for bucket in self.buckets:
            for t in bucket:
                t.fill_(value)

    def pid(self):
        import os

        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class BucketTrainer:
    """Puts views of one NIXL-registered buffer, as miles' trainer does with
    its bucket: every update's refs describe the same sender memory."""

    def __init__(self, nbytes: int = 1 << 16):
        from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread

        configure_nixl_progress_thread()
        self.nbytes = nbytes
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        ray.experimental.register_nixl_memory(self.buf)

    def put(self, tensors: List[torch.Tensor], offset: int = 0):
        """Copy ``tensors`` into the buffer back to back (from byte
        ``offset``) and put the views."""
        views = []
        for t in tensors:
            view = self.buf[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
            offset += t.nbytes
        return [ray.put(views, _tensor_transport="nixl")]

    def new_buffer(self):
        """Deregister the buffer and register a fresh one (the sender's NIXL
        metadata version moves on). Returns whether the address changed."""
        old = self.buf.data_ptr()
        ray.experimental.deregister_nixl_memory(self.buf)
        self.buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        ray.experimental.register_nixl_memory(self.buf)
        return self.buf.data_ptr() != old

    def bump_version(self):
        """Register and deregister a scratch tensor: the sender's NIXL
        metadata version moves on while the buffer stays registered."""
        scratch = torch.zeros(4096, dtype=torch.uint8)
        ray.experimental.register_nixl_memory(scratch)
        ray.experimental.deregister_nixl_memory(scratch)
        return True

    def notifications(self) -> int:
        """NIXL notifications this process's agent received since the last call."""
        from ray.experimental.rdt.util import get_tensor_transport_manager

        agent = get_tensor_transport_manager("NIXL").get_nixl_agent()
        return sum(len(v) for v in agent.get_new_notifs().values())

    def pid(self):
        return os.getpid()
