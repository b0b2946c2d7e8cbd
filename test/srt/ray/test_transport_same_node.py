"""The same-node transport's pure parts: CMA reads, copy planning, the mapping cache (rdt/transport/)."""

from __future__ import annotations


import pytest
import torch


# --------------------------------------------------------------------------- #
# Cross-memory attach (the CPU half of the same-node path)
# --------------------------------------------------------------------------- #
def test_cma_split_keeps_order_and_bytes():
    from sglang.srt.ray.rdt.transport.cma import split_copies

    copies = [(1000, 5000, 3 << 20), (9000, 70000, 1 << 20)]
    parts = split_copies(copies, 2)
    assert len(parts) == 2
    assert [sum(c[2] for c in p) for p in parts] == [2 << 20, 2 << 20]
    flat = [c for p in parts for c in p]
    # contiguous pieces, in order, covering every byte once
    assert flat[0] == (1000, 5000, 2 << 20) and flat[1] == (1000 + (2 << 20), 5000 + (2 << 20), 1 << 20)
    assert flat[2] == (9000, 70000, 1 << 20)
    assert split_copies([(0, 0, 100)], 4) == [[(0, 0, 100)]]  # small: one part


# A fresh interpreter, not a fork: forking a process that holds a Ray driver
# (the test session's) copies its gRPC state, and torch ops in a forked child
# may wait on OpenMP threads that did not survive the fork.
_CHILD = """
import array, os, sys
buf = array.array("f", range(3 * 2**18))  # 3 MiB of float32 0, 1, 2, ...
addr, n = buf.buffer_info()
print(os.getpid(), addr, n * buf.itemsize, flush=True)
sys.stdin.readline()
"""


def test_cma_reads_another_process_and_reports_faults():
    import errno
    import subprocess
    import sys

    from sglang.srt.ray.rdt.transport.cma import CmaError, CmaReader, process_start_time

    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid, addr, nbytes = map(int, child.stdout.readline().split())
        start = process_start_time(pid)
        assert start is not None and start == process_start_time(pid)
        reader = CmaReader(threads=2)
        assert reader.probe(pid, addr) is None
        dst = torch.zeros(nbytes // 4)
        half = nbytes // 2
        assert reader.read(pid, [(dst.data_ptr(), addr, half), (dst.data_ptr() + half, addr + half, nbytes - half)]) == nbytes
        assert torch.equal(dst, torch.arange(3 * 2**18, dtype=torch.float32))
        with pytest.raises(CmaError) as e:  # an address the sender never mapped
            reader.read(pid, [(dst.data_ptr(), 8, 16)])
        assert e.value.errno == errno.EFAULT and "not mapped in the sender" in str(e.value)
        reader.close()
    finally:
        child.communicate("\n", timeout=30)
    assert process_start_time(pid) is None or process_start_time(pid) != start
    why = CmaReader(threads=1).probe(pid, addr)
    assert why is not None and "ESRCH" in why


def test_cma_resumes_after_partial_reads(monkeypatch):
    import ctypes

    from sglang.srt.ray.rdt.transport import cma

    src = (ctypes.c_ubyte * 64)(*range(64))
    dst = (ctypes.c_ubyte * 64)()
    calls = []

    def stingy_readv(pid, local, nl, remote, nr, flags):
        # copy at most 10 bytes per call, across iovec boundaries, like a
        # kernel that stops at a page it cannot pin
        budget, done = 10, 0
        for i in range(nl):
            n = min(local[i].iov_len, budget - done)
            if n <= 0:
                break
            ctypes.memmove(local[i].iov_base, remote[i].iov_base, n)
            done += n
            if n < local[i].iov_len:
                break
        calls.append(done)
        return done

    monkeypatch.setattr(cma, "_readv", lambda: stingy_readv)
    base_d, base_s = ctypes.addressof(dst), ctypes.addressof(src)
    copies = [(base_d, base_s, 25), (base_d + 25, base_s + 25, 14), (base_d + 39, base_s + 39, 25)]
    assert cma._read_all(1, copies) == 64
    assert bytes(dst) == bytes(range(64)) and len(calls) == 7


class FakeDriver:
    """The driver calls the mapping cache makes when it closes a mapping."""

    def __init__(self, closed):
        self.closed = closed

    def push(self, ordinal):
        pass

    def pop(self):
        pass

    def ipc_close(self, ptr):
        self.closed.append(ptr)


def test_ipc_mappings_of_persistent_buffers_survive_the_end_of_an_update(monkeypatch):
    from sglang.srt.ray.rdt.transport import cuda_driver
    from sglang.srt.ray.rdt.transport.mapping_cache import Mapping, MappingCache

    closed = []


    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver(closed))
    t = MappingCache()
    t.fetches = 3  # this update read with fetches 1..3
    t.mappings = {
        ("trainer-a", 0x1000): Mapping(b"a", 1 << 30, 0xA000, 1, 2, persistent=True),
        ("trainer-a", 0x2000): Mapping(b"b", 1 << 20, 0xB000, 1, 3, persistent=False),
        ("trainer-b", 0x1000): Mapping(b"c", 1 << 30, 0xC000, 1, 1, persistent=True),
        # persistent, but no fetch of this update read it (its owner may have
        # freed it): closed at the update's end
        ("trainer-b", 0x9000): Mapping(b"d", 1 << 20, 0xD000, 1, 0, persistent=True),
    }
    t.senders = ["trainer-a", "trainer-b"]
    t.plans["some"] = object()
    gen = t.generation
    # end of an update: the trainer may free what it put, but not its
    # persistent bucket slots (it releases those through the ranks first)
    assert t.close_all(keep_persistent=True) == 2
    assert closed == [0xB000, 0xD000] and set(t.mappings) == {("trainer-a", 0x1000), ("trainer-b", 0x1000)}
    assert t.generation > gen and not t.plans  # no copy plan may point into a closed mapping
    # the next update reads only trainer-a's: trainer-b's goes at its end
    t.fetches = 5
    t.mappings[("trainer-a", 0x1000)].last_used = 4
    assert t.close_all(keep_persistent=True) == 1
    assert closed == [0xB000, 0xD000, 0xC000]
    assert t.senders == ["trainer-a"]
    t.mappings[("trainer-b", 0x1000)] = Mapping(b"c", 1 << 30, 0xC000, 1, 5, persistent=True)
    t.senders.append("trainer-b")
    closed.clear()
    # the client of trainer-a closes: only its mappings go
    assert t.release_sender("trainer-a") == 1
    assert closed == [0xA000] and set(t.mappings) == {("trainer-b", 0x1000)}
    assert t.senders == ["trainer-b"]
    # engine shutdown: everything
    assert t.close_all() == 1 and closed[-1] == 0xC000 and not t.mappings and not t.senders


def test_ipc_part_is_persistent_only_when_every_segment_was_declared():
    from sglang.srt.ray.rdt.transport.metadata import IpcPart
    from sglang.srt.ray.rdt.transport.persistent import all_persistent, mark_persistent

    part = IpcPart(node_id="n", sender="s", pid=1, device_uuid="GPU-x", segments=[], tensors=[])
    assert part.persistent is False  # refs of ordinary tensors: mappings closed after every update
    assert all_persistent(0, []) is False
    assert mark_persistent(torch.zeros(4)) is False  # CPU tensors have no CUDA segment


# --------------------------------------------------------------------------- #
# Copy planning and the plan cache of the CUDA IPC path
# --------------------------------------------------------------------------- #
def test_plan_copies_merges_only_copies_that_continue_on_both_sides():
    from sglang.srt.ray.rdt.transport.copy_plan import plan_copies

    copies = [(1000, 5000, 10), (1010, 5010, 6), (1016, 6000, 4), (2000, 6004, 0), (2000, 6004, 8)]
    # the first two continue each other; the third jumps on the source side;
    # the empty one vanishes; the last continues the third only on the source side
    assert plan_copies(copies) == [(1000, 5000, 16), (1016, 6000, 4), (2000, 6004, 8)]
    assert plan_copies([]) == []


def test_spread_balances_bytes_keeps_order_and_never_makes_empty_queues():
    from sglang.srt.ray.rdt.transport.copy_plan import spread

    copies = [(i, i, n) for i, n in enumerate([40, 10, 10, 10, 10, 20])]
    queues = spread(copies, 2)
    assert [c for q in queues for c in q] == copies  # order kept, nothing lost
    assert [sum(c[2] for c in q) for q in queues] == [50, 50]
    assert spread(copies[:1], 4) == [copies[:1]]  # more streams than copies
    assert spread(copies, 1) == [copies]


def test_a_cached_copy_plan_is_used_only_while_every_mapping_it_points_into_is_open(monkeypatch):
    from sglang.srt.ray.rdt.transport import cuda_driver
    from sglang.srt.ray.rdt.transport.mapping_cache import CopyPlan, Mapping, MappingCache
    from sglang.srt.ray.rdt.transport.metadata import IpcPart


    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver([]))
    cache = MappingCache()
    ipc = IpcPart(node_id="n", sender="s", pid=1, device_uuid="GPU-x",
                  segments=[(0x1000, 1 << 20, b"h")], tensors=[(0, 0, 64)])
    m = cache.mappings[("s", 0x1000)] = Mapping(b"h", 1 << 20, 0xA000, 0, 0)
    plan = CopyPlan(key="k", generation=cache.generation, dst_ptrs=[0xD000], segments=ipc.segments,
                    tensors=ipc.tensors, copies=1, queues=[[(0xD000, 0xA000, 64)]], streams=[],
                    batch=None, mappings=[m])
    cache.keep_plan("k", plan)
    assert cache.plan("k", [0xD000], ipc) is plan  # the same pull again: reused
    assert cache.plan("k", [0xE000], ipc) is None  # other targets: planned afresh, dropped
    cache.keep_plan("k", plan)
    moved = IpcPart(**{**ipc.__dict__, "segments": [(0x1000, 1 << 20, b"other")]})
    assert cache.plan("k", [0xD000], moved) is None  # the sender re-allocated: new handle
    cache.keep_plan("k", plan)
    cache.close(("s", 0x1000))  # a mapping closed: no plan may point into it
    assert not cache.plans and cache.plan("k", [0xD000], ipc) is None
    cache.enabled = False  # no caching: nothing is kept or reused
    cache.keep_plan("k", CopyPlan(**{**plan.__dict__, "generation": cache.generation}))
    assert cache.plan("k", [0xD000], ipc) is None
