"""Ray actors for tests and demos: a rank and a trainer.

``ToyRank`` is the product's standalone rank (``StandaloneRank``: the
SchedulerActor's weight-sync API over the rank core) around a small torch
model, plus what tests need to look inside. ``ToyTrainer`` puts buckets over
NIXL (or ``SGLANG_IPC``, the same-node transport) and keeps them alive until
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

from sglang.test.rdt_standalone import StandaloneRank


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


class ToyRankBase(StandaloneRank):
    """The product's standalone rank (the SchedulerActor's weight-sync API over
    the rank core) around a toy model, with what tests need to look inside."""

    def __init__(self, seed: int = 0, width: int = 64, pull_timeout_s: float = 30.0):
        self._init(toy_model(seed, width), pull_timeout_s)

    def _init(self, model, pull_timeout_s: float) -> None:
        StandaloneRank.__init__(self, model, pull_timeout_s=pull_timeout_s, rank="toy")

    def set_env(self, key: str, value):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
        return True

    def reset(self, seed: int = 0, width: int = 64, pull_timeout_s: float = 30.0, model=None):
        """A fresh model and rank core (importing sglang once per actor is slow)."""
        self._rdt_sync.shutdown()
        self._rdt_sync.loop.stop()
        self._init(model if model is not None else toy_model(seed, width), pull_timeout_s)
        return True

    def reset_big(self, n: int, numel: int, pull_timeout_s: float = 20.0):
        model = torch.nn.ParameterDict(
            {f"w{i}": torch.nn.Parameter(torch.zeros(numel)) for i in range(n)}
        )
        return self.reset(pull_timeout_s=pull_timeout_s, model=model)

    def deregister(self):
        return self._rdt_sync.receiver.deregister()

    def state(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def checksums(self):
        return checksum(dict(self.model.named_parameters()))

    def pointers(self):
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}

    def reallocate(self, name: str):
        """Give parameter ``name`` new storage (as post-load processing may)."""
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.clone()
        return p.data_ptr()

    def registered_ptrs(self):
        book = self._rdt_sync.receiver._registration.book
        return sorted(k[1] for k in book._entries) if book is not None else []

    def make_noncontiguous(self, name: str):
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.t().contiguous().t()
        return p.is_contiguous()

    def pull_with_targets_dropped(self, refs, names):
        """Simulate Ray losing the (weakly held) targets: it then fetches into
        buffers of its own. The rank must notice and fail loudly."""
        import ray.experimental as rx

        real = rx.set_target_for_ref
        rx.set_target_for_ref = lambda ref, targets: None
        try:
            return self.pull_weights(refs, names)
        finally:
            rx.set_target_for_ref = real

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


ToyRank = ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)(ToyRankBase)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class ToyTrainer:
    def __init__(self, transport: str = "nixl"):
        # What a trainer that puts with NIXL itself does once (docs): its NIXL
        # progress thread at idle priority.
        from sglang.srt.ray.rdt import start_nixl_agent

        start_nixl_agent()
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
