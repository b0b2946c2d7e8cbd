"""The same-node transport without a GPU (rdt/transport/cma.py, cuda_ipc.py, cuda_driver.py).

CPU tensors are read out of another process with ``process_vm_readv``: for
real, from a child interpreter. The CUDA IPC logic — which segments a sender
exports and when it asks the driver again, which mappings a reader opens,
keeps and closes — runs against :class:`FakeCuda`, a stand-in for the driver
whose "GPU memory" is host memory: a segment is a CPU buffer, its handle
names it, and opening the handle maps it at its own address, so every read
moves real bytes that the tests compare.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import struct
import subprocess
import sys
import types
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import wait_until
from sglang.srt.ray.rdt.transport import cma, cuda_driver, cuda_ipc
from sglang.srt.ray.rdt.transport.cma import (
    CmaError,
    CmaPath,
    merge_copies,
    process_start_time,
)
from sglang.srt.ray.rdt.transport.cuda_driver import CudaDriverError, copy_rows
from sglang.srt.ray.rdt.transport.cuda_ipc import CudaIpcExporter, CudaIpcReader
from sglang.srt.ray.rdt.transport.metadata import (
    CmaPart, IpcPart, MappingFailed, Targets, addresses)

MiB = 1 << 20


# --------------------------------------------------------------------------- #
# Cross-memory attach (the CPU half of the same-node path)
# --------------------------------------------------------------------------- #
def test_merge_copies_joins_only_copies_that_continue_on_both_sides():
    dst = [1000, 1010, 1016, 2000, 2000]
    src = [5000, 5010, 6000, 6004, 6004]
    nbytes = [10, 6, 4, 0, 8]
    # the first two continue each other; the third jumps on the source side;
    # the empty one vanishes; the last continues the third only on the source side
    assert merge_copies(dst, src, nbytes) == [(1000, 5000, 16), (1016, 6000, 4), (2000, 6004, 8)]
    assert merge_copies([], [], []) == []


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


@pytest.fixture
def child_buffer():
    """(pid, address, nbytes) of 3 MiB of float32 0, 1, 2, ... in a live child process."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, addr, nbytes = map(int, child.stdout.readline().split())
        yield types.SimpleNamespace(pid=pid, addr=addr, nbytes=nbytes, proc=child)
    finally:
        if child.poll() is None:
            child.communicate("\n", timeout=30)


def _expected_floats(nbytes):
    return torch.arange(nbytes // 4, dtype=torch.float32)


def test_cma_reads_another_process_and_reports_faults(child_buffer):
    c = child_buffer
    start = process_start_time(c.pid)
    assert start is not None and start == process_start_time(c.pid)
    assert cma.probe(c.pid, c.addr) is None
    dst = torch.zeros(c.nbytes // 4)
    half = c.nbytes // 2
    copies = [(dst.data_ptr(), c.addr, half), (dst.data_ptr() + half, c.addr + half, c.nbytes - half)]
    assert cma.read_all(c.pid, copies) == c.nbytes
    assert torch.equal(dst, _expected_floats(c.nbytes))
    with pytest.raises(CmaError) as e:  # an address the sender never mapped
        cma.read_all(c.pid, [(dst.data_ptr(), 8, 16)])
    assert e.value.errno == errno.EFAULT and "not mapped in the sender" in str(e.value)
    c.proc.communicate("\n", timeout=30)
    assert process_start_time(c.pid) is None or process_start_time(c.pid) != start
    why = cma.probe(c.pid, c.addr)
    assert why is not None and "ESRCH" in why


def test_cma_path_reads_a_part_into_targets_and_says_when_it_cannot(child_buffer, monkeypatch):
    c = child_buffer
    n = c.nbytes // 4
    part = CmaPart(node_id="node-a", sender="child", pid=c.pid, start_time=process_start_time(c.pid),
                   address=np.array([c.addr, c.addr + 4 * (n // 3)], np.int64),
                   nbytes=np.array([4 * (n // 3), 4 * (n - n // 3)], np.int64))
    path = CmaPath()
    cpu = torch.device("cpu")
    assert path.unusable(part, cpu, "node-a") is None
    assert path.unusable(part, cpu, "node-b") == "the sender is on another node"
    assert path.unusable(part, torch.device("cuda", 0), "node-a") == "target buffers on cuda:0"
    monkeypatch.setenv("SGLANG_RDT_CMA", "0")
    assert path.unusable(part, cpu, "node-a") == "SGLANG_RDT_CMA=0"
    monkeypatch.delenv("SGLANG_RDT_CMA")

    dst = torch.zeros(n)
    targets = Targets.of([dst[: n // 3], dst[n // 3:]])
    res = path.read(part, targets)
    assert (res.path, res.method, res.tensors, res.bytes) == ("cma", "process_vm_readv", 2, c.nbytes)
    assert torch.equal(dst, _expected_floats(c.nbytes))

    # Sizes that do not fit are refused before anything is read.
    with pytest.raises(ValueError, match="target buffer 1 holds"):
        path.read(part, Targets.of([dst[: n // 3], dst[n // 3: -1]]))

    # A read the kernel refuses is found by the probe before a byte is
    # written, and the sender is left to NIXL from then on.
    bad = CmaPart(**{**part.__dict__, "address": np.array([8, 8 + part.nbytes[0]], np.int64)})
    before = dst.clone()
    with pytest.raises(MappingFailed, match="EFAULT"):
        path.read(bad, targets)
    assert torch.equal(dst, before)
    assert "EFAULT" in path.unusable(part, cpu, "node-a")

    c.proc.communicate("\n", timeout=30)
    assert "has exited" in CmaPath().unusable(part, cpu, "node-a")


def test_cma_resumes_after_partial_reads(monkeypatch):
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
    assert cma.read_all(1, copies) == 64
    assert bytes(dst) == bytes(range(64)) and calls == [10] * 6 + [4]


def test_cma_read_that_makes_no_progress_fails_instead_of_looping(monkeypatch):
    monkeypatch.setattr(cma, "_readv", lambda: lambda *a: 0)
    with pytest.raises(CmaError, match="no progress after 0 bytes"):
        cma.read_all(1, [(1000, 2000, 64)])


# --------------------------------------------------------------------------- #
# CUDA IPC against a fake driver
# --------------------------------------------------------------------------- #
class FakeCuda:
    """The driver calls of ``cuda_ipc``, over host memory.

    A segment is a CPU byte tensor (its address is the segment's base) with
    an allocation id; its IPC handle packs (base, id). Opening a handle maps
    the segment at its own address (this is one process), refused when the
    segment was freed since or when the test says so. Copies move real bytes.
    ``calls`` counts every call, ``events`` records the order of the reader's.
    """

    def __init__(self):
        self.segments = {}  # base -> [size, allocation id, storage]
        self.ids = itertools.count(1)
        self.calls = Counter()
        self.asked = Counter()  # base -> buffer_id calls
        self.events = []
        self.contexts = []  # ordinals pushed and not popped
        self.refuse = set()  # handles ipc_open refuses
        self.open = {}  # ptr -> handle of the mappings open now
        self.copy_error = None  # raised by the next copy

    # memory
    def alloc(self, nbytes):
        storage = torch.zeros(nbytes, dtype=torch.uint8)
        self.segments[storage.data_ptr()] = [nbytes, next(self.ids), storage]
        return storage

    def reallocate(self, storage):
        """Free ``storage``'s segment and allocate one of the same size at
        the same address: a new allocation id."""
        self.segments[storage.data_ptr()][1] = next(self.ids)

    def handle(self, base):
        return struct.pack("<QQ", base, self.segments[base][1]).ljust(64, b"\0")

    def handle_of(self, storage):
        return self.handle(storage.data_ptr())

    # driver calls
    def push(self, ordinal):
        self.calls["push"] += 1
        self.contexts.append(ordinal)

    def pop(self):
        self.calls["pop"] += 1
        self.contexts.pop()

    def address_range(self, ptr):
        self.calls["address_range"] += 1
        for base, (size, _, _) in self.segments.items():
            if base <= ptr < base + size:
                return base, size
        raise CudaDriverError("cuMemGetAddressRange", 1, "CUDA_ERROR_INVALID_VALUE")

    def buffer_id(self, base):
        self.calls["buffer_id"] += 1
        self.asked[base] += 1
        seg = self.segments.get(base)
        return seg[1] if seg else None

    def ipc_handle(self, base):
        self.calls["ipc_handle"] += 1
        return self.handle(base)

    def ipc_open(self, handle):
        self.calls["ipc_open"] += 1
        base, alloc_id = struct.unpack("<QQ", handle[:16])
        seg = self.segments.get(base)
        if handle in self.refuse or seg is None or seg[1] != alloc_id:
            raise CudaDriverError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
        self.events.append(("open", base))
        self.open[base] = handle
        return base

    def ipc_close(self, ptr):
        self.calls["ipc_close"] += 1
        self.events.append(("close", ptr))
        del self.open[ptr]

    def memcpy_async(self, dst, src, nbytes, stream):
        self.calls["memcpy_async"] += 1
        self._copy("ce", [dst], [src], [nbytes])

    def memcpy_batch(self, drv, dst, src, nbytes, stream, src_dev, dst_dev):
        assert drv is self and src_dev != dst_dev
        self.calls["memcpy_batch"] += 1
        self._copy("batch", dst, src, nbytes)

    def _copy(self, how, dst, src, nbytes):
        if self.copy_error is not None:
            err, self.copy_error = self.copy_error, None
            self.events.append(("copy failed", how))
            raise err
        for d, s, n in zip(dst, src, nbytes):
            assert any(b <= int(s) and int(s) + int(n) <= b + self.segments[b][0] for b in self.open), \
                "a copy read memory that is not mapped"
            ctypes.memmove(int(d), int(s), int(n))
        self.events.append(("copy", how))


class FakeStream:
    def __init__(self, events):
        self.events = events
        self.cuda_stream = 0x5EAB

    def synchronize(self):
        self.events.append(("sync",))


SENDER_GPU, LOCAL_GPU = "GPU-sender", "GPU-local"


@pytest.fixture
def fake_cuda(monkeypatch):
    """The fake driver in place of ``cuda_driver.driver()``; GPU 0 (the
    reader's) and GPU 1 (the sender's) visible; no SM copy kernel."""
    drv = FakeCuda()
    monkeypatch.setattr(cuda_driver, "driver", lambda: drv)
    monkeypatch.setattr(cuda_driver, "memcpy_batch", drv.memcpy_batch)

    def no_kernel(ordinal):
        drv.calls["copy_kernel"] += 1
        raise OSError("no libnvrtc here")

    monkeypatch.setattr(cuda_driver, "copy_kernel", no_kernel)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda i: [LOCAL_GPU, SENDER_GPU][i])
    monkeypatch.setattr(cuda_ipc, "local_ordinal_of", {LOCAL_GPU: 0, SENDER_GPU: 1}.get)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(drv.events))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield drv
    assert drv.contexts == [], "a context pushed was not popped"


def _export(exporter, tensors, ordinal, node_id):
    return exporter.export(*addresses(tensors), ordinal, node_id)


def _view(storage, offset, nbytes):
    return storage[offset: offset + nbytes]


def _fill(t, seed):
    t.copy_(torch.arange(seed, seed + t.numel(), dtype=torch.int64).to(torch.uint8))


# -- sender ------------------------------------------------------------------ #
class Frees:
    """The device's count of memory given back (``cuda_ipc.device_frees``)."""

    def __init__(self, monkeypatch):
        self.n = 0
        monkeypatch.setattr(cuda_ipc, "device_frees", lambda ordinal: self.n)


def _pool(*storages):
    """A kept-memory source listing ``storages`` as segments (a staging pool)."""
    return lambda: [(s.data_ptr(), s.numel()) for s in storages]


def test_tensors_in_kept_memory_are_described_by_their_segments_with_a_handle_asked_once(fake_cuda, monkeypatch):
    drv = fake_cuda
    Frees(monkeypatch)
    a, b = drv.alloc(4096), drv.alloc(8192)
    exporter = CudaIpcExporter("sender")
    exporter.add_source(1, _pool(a, b))
    tensors = [_view(a, 0, 1000), _view(a, 1024, 2000), _view(b, 512, 4096)]
    part = _export(exporter, tensors, 1, "node-a")
    assert (part.sender, part.pid, part.node_id, part.device_uuid) == ("sender", os.getpid(), "node-a",
                                                                      SENDER_GPU)
    assert part.segments == sorted([(a.data_ptr(), 4096, drv.handle_of(a)),
                                    (b.data_ptr(), 8192, drv.handle_of(b))])
    bases = np.array([s[0] for s in part.segments])
    assert (bases[part.seg] + part.offset).tolist() == [t.data_ptr() for t in tensors]
    assert part.nbytes.tolist() == [1000, 2000, 4096] and part.kept_id > 0
    assert drv.calls["ipc_handle"] == 2 and drv.calls["push"] == drv.calls["pop"] == 1

    # The same places again (new tensors from the pool): the same description,
    # nobody asked; other places in the same segments: found in the table.
    drv.calls.clear()
    assert _export(exporter, tensors, 1, "node-a") is part
    again = _export(exporter, [_view(b, 0, 16), _view(a, 4000, 96)], 1, "node-a")
    assert not drv.calls and [s[0] for s in again.segments] == sorted([a.data_ptr(), b.data_ptr()])


def test_a_tensor_outside_kept_memory_is_refused_by_index(fake_cuda, monkeypatch):
    """One rule: anything not kept is gathered into kept memory by the trainer;
    the exporter never describes it (nothing a rank would map per segment)."""
    drv = fake_cuda
    Frees(monkeypatch)
    pool, loose = drv.alloc(8192), drv.alloc(4096)
    exporter = CudaIpcExporter("sender")
    exporter.add_source(1, _pool(pool))
    with pytest.raises(cuda_ipc.NotKept, match="tensor 1 does not lie in kept memory") as e:
        _export(exporter, [_view(pool, 0, 64), _view(loose, 0, 64), _view(pool, 64, 64)], 1, "node-a")
    assert e.value.index == 1
    with pytest.raises(cuda_ipc.NotKept):  # straddling the pool's end
        exporter.export(np.array([pool.data_ptr() + 8000]), np.array([400]), 1, "node-a")
    mask = exporter.kept_mask(*addresses([_view(loose, 0, 8), _view(pool, 8, 8)]), 1)
    assert mask.tolist() == [False, True]
    assert drv.calls["ipc_handle"] == 1  # only the pool's segment was ever asked for


def test_a_pool_that_grew_is_looked_at_again_and_a_withdrawn_one_is_not_kept(fake_cuda, monkeypatch):
    drv = fake_cuda
    Frees(monkeypatch)
    first, second = drv.alloc(4096), drv.alloc(4096)
    segments = [first]
    source = lambda: [(s.data_ptr(), s.numel()) for s in segments]  # noqa: E731
    exporter = CudaIpcExporter("sender")
    exporter.add_source(1, source)
    _export(exporter, [_view(first, 0, 64)], 1, "node-a")
    segments.append(second)  # the pool allocated another segment
    part = _export(exporter, [_view(second, 0, 64)], 1, "node-a")
    assert part.segments == [(second.data_ptr(), 4096, drv.handle_of(second))]
    exporter.remove_source(1, source)  # the pool is being freed
    with pytest.raises(cuda_ipc.NotKept):
        _export(exporter, [_view(first, 0, 64)], 1, "node-a")


def test_kept_memory_is_checked_again_after_the_device_freed_memory(fake_cuda, monkeypatch):
    """A live pool's segments are not freed, but the table is not trusted
    forever: once the device gave memory back, every kept segment's
    allocation id is compared, and one allocated anew gets a new handle."""
    drv, frees = fake_cuda, Frees(monkeypatch)
    a, b = drv.alloc(4096), drv.alloc(4096)
    exporter = CudaIpcExporter("sender")
    exporter.add_source(1, _pool(a, b))
    tensors = [_view(a, 0, 64), _view(b, 0, 64)]
    first = _export(exporter, tensors, 1, "node-a")
    drv.asked.clear()
    assert _export(exporter, tensors, 1, "node-a") is first and not drv.asked  # nothing was freed
    frees.n += 1  # e.g. the trainer emptied PyTorch's cache: nothing of the pool changed
    assert _export(exporter, tensors, 1, "node-a") is first
    assert drv.asked == Counter({a.data_ptr(): 1, b.data_ptr(): 1})
    drv.reallocate(a)  # same address, same size: another allocation
    frees.n += 1
    drv.calls.clear()
    second = _export(exporter, tensors, 1, "node-a")
    handles = {s[0]: s[2] for s in second.segments}
    assert second is not first and handles[a.data_ptr()] == drv.handle_of(a) != first.segments[0][2]
    assert drv.calls["ipc_handle"] == 1  # only the re-allocated segment's


def test_a_buffer_registered_with_nixl_is_kept_memory(fake_cuda, monkeypatch):
    """miles' bucket: registered once, put every round; a rank maps it once."""
    drv = fake_cuda
    Frees(monkeypatch)
    seg = drv.alloc(8192)
    bucket = _view(seg, 1024, 4096)  # a block inside the allocator's segment
    exporter = CudaIpcExporter("sender")
    exporter.keep_registered(1, bucket.data_ptr())
    part = _export(exporter, [_view(bucket, 0, 100), _view(bucket, 128, 100)], 1, "node-a")
    assert part.segments == [(seg.data_ptr(), 8192, drv.handle_of(seg))]
    assert part.offset.tolist() == [1024, 1152] and drv.calls["address_range"] == 1


def test_a_storage_deregistered_from_nixl_is_kept_no_more(fake_cuda, monkeypatch):
    """A storage registered only for a put's life (NIXL's put registers what it sends) is not looked at once
    deregistered: never asked for its range again, its tensors refused (read through NIXL)."""
    drv = fake_cuda
    Frees(monkeypatch)
    bucket, loose, other = drv.alloc(4096), drv.alloc(4096), drv.alloc(4096)
    registered = {bucket.data_ptr(), loose.data_ptr()}
    exporter = CudaIpcExporter("sender", still_registered=registered.__contains__)
    exporter.keep_registered(1, bucket.data_ptr())
    exporter.keep_registered(1, loose.data_ptr())
    assert len(_export(exporter, [_view(loose, 0, 64), _view(bucket, 0, 64)], 1, "node-a").segments) == 2
    registered.discard(loose.data_ptr())  # its ref died: NIXL deregistered it
    exporter.keep_registered(1, other.data_ptr())  # a new registration: the table is built again
    registered.add(other.data_ptr())
    drv.calls.clear()
    assert len(_export(exporter, [_view(other, 0, 64), _view(bucket, 64, 64)], 1, "node-a").segments) == 2
    assert drv.calls["address_range"] == 2  # the bucket's and the new one's, not the deregistered one's
    with pytest.raises(cuda_ipc.NotKept, match="tensor 0 does not lie"):
        _export(exporter, [_view(loose, 128, 64)], 1, "node-a")


def test_a_description_remembered_is_dropped_once_its_storage_is_deregistered(fake_cuda, monkeypatch):
    """The same tensors put again after their storage's registration ended (no device frees in between) are
    described anew, not from the remembered description: they are refused, not read in place."""
    drv = fake_cuda
    Frees(monkeypatch)
    loose = drv.alloc(4096)
    registered = {loose.data_ptr()}
    exporter = CudaIpcExporter("sender", still_registered=registered.__contains__)
    exporter.keep_registered(1, loose.data_ptr())
    tensors = [_view(loose, 0, 64), _view(loose, 64, 64)]
    assert _export(exporter, tensors, 1, "node-a") is _export(exporter, tensors, 1, "node-a")  # remembered
    registered.discard(loose.data_ptr())  # the ref that registered it died: NIXL deregistered it
    with pytest.raises(cuda_ipc.NotKept, match="tensor 0 does not lie"):
        _export(exporter, tensors, 1, "node-a")


# -- reader ------------------------------------------------------------------ #
def _part(drv, storages, tensors, sender="sender", pid=None, gpu=SENDER_GPU):
    """An IpcPart of ``tensors`` (views of ``storages``, kept memory) as a sender describes them."""
    bases = [s.data_ptr() for s in storages]
    seg = [next(i for i, s in enumerate(storages)
                if s.data_ptr() <= t.data_ptr() < s.data_ptr() + s.numel()) for t in tensors]
    return IpcPart(
        node_id="node-a", sender=sender, pid=os.getpid() if pid is None else pid, device_uuid=gpu,
        segments=[(b, s.numel(), drv.handle_of(s)) for b, s in zip(bases, storages)],
        seg=np.array(seg, np.int64),
        offset=np.array([t.data_ptr() - bases[i] for t, i in zip(tensors, seg)], np.int64),
        nbytes=np.array([t.nbytes for t in tensors], np.int64))


GPU0 = torch.device("cuda", 0)


def _sender_tensors(drv, seed=1):
    seg = drv.alloc(8192)
    tensors = [_view(seg, 0, 3000), _view(seg, 4096, 1000)]
    for i, t in enumerate(tensors):
        _fill(t, seed + i)
    return seg, tensors, _part(drv, [seg], tensors)


def _targets(tensors):
    return Targets.of([torch.zeros(t.nbytes, dtype=torch.uint8) for t in tensors])


def test_a_kept_segment_is_mapped_once_and_read_again_from_the_same_mapping(fake_cuda):
    drv = fake_cuda
    seg, tensors, part = _sender_tensors(drv)
    reader = CudaIpcReader()
    targets = _targets(tensors)
    first = reader.read(part, targets, GPU0)
    assert (first.opened, first.reused, first.method) == (1, 0, "batch")
    assert all(torch.equal(d, s) for d, s in zip(targets.tensors, tensors))
    for seed in (7, 9):  # the trainer writes new bytes into its pool
        for i, t in enumerate(tensors):
            _fill(t, seed + i)
        res = reader.read(part, targets, GPU0)
        assert (res.opened, res.reused) == (0, 1)
        assert all(torch.equal(d, s) for d, s in zip(targets.tensors, tensors))
    assert drv.calls["ipc_open"] == 1 and drv.calls["ipc_close"] == 0
    assert reader.stats() == {"kept_mappings": 1, "kept_bytes": 8192, "kept_senders": 1}
    assert (res.path, res.tensors, res.bytes) == ("cuda_ipc", 2, 4000)


def test_a_failed_copy_leaves_the_mapping_kept_for_the_next_read(fake_cuda):
    drv = fake_cuda
    seg, tensors, part = _sender_tensors(drv)
    drv.copy_error = RuntimeError("an illegal address was encountered")
    reader = CudaIpcReader()
    with pytest.raises(RuntimeError, match="illegal address"):
        reader.read(part, _targets(tensors), GPU0)
    assert drv.events == [("open", seg.data_ptr()), ("copy failed", "batch")]
    targets = _targets(tensors)
    assert reader.read(part, targets, GPU0).reused == 1  # the next read: the same mapping
    assert all(torch.equal(d, s) for d, s in zip(targets.tensors, tensors))


def test_a_new_handle_at_a_kept_base_closes_the_old_mapping(fake_cuda):
    drv = fake_cuda
    seg, tensors, part = _sender_tensors(drv)
    reader = CudaIpcReader()
    reader.read(part, _targets(tensors), GPU0)
    drv.reallocate(seg)  # the sender freed the pool and allocated it again
    _fill(tensors[0], 42)
    moved = _part(drv, [seg], tensors)
    assert moved.segments[0][2] != part.segments[0][2]
    drv.events.clear()
    targets = _targets(tensors)
    res = reader.read(moved, targets, GPU0)
    assert drv.events[:2] == [("close", seg.data_ptr()), ("open", seg.data_ptr())]
    assert (res.opened, res.reused) == (1, 0) and torch.equal(targets.tensors[0], tensors[0])
    assert reader.stats()["kept_mappings"] == 1 and list(drv.open.values()) == [moved.segments[0][2]]


def test_sizes_that_do_not_fit_are_refused_before_any_mapping(fake_cuda):
    drv = fake_cuda
    seg, tensors, part = _sender_tensors(drv)
    reader = CudaIpcReader()
    too_small = Targets.of([torch.zeros(3000, dtype=torch.uint8), torch.zeros(999, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="target buffer 1 holds 999 bytes, the source tensor 1000"):
        reader.read(part, too_small, GPU0)
    with pytest.raises(ValueError, match=r"Length of tensor_buffers \(1\) does not match"):
        reader.read(part, Targets.of([torch.zeros(3000, dtype=torch.uint8)]), GPU0)
    assert drv.calls["ipc_open"] == 0 and drv.calls["push"] == 0


def test_a_segment_that_cannot_be_mapped_fails_the_read_before_any_byte_moves(fake_cuda):
    drv = fake_cuda
    a, b = drv.alloc(4096), drv.alloc(4096)
    tensors = [_view(a, 0, 64), _view(b, 0, 64)]
    _fill(tensors[0], 3)
    part = _part(drv, [a, b], tensors)
    drv.refuse.add(drv.handle_of(b))
    targets = _targets(tensors)
    with pytest.raises(MappingFailed, match="cuIpcOpenMemHandle"):
        CudaIpcReader().read(part, targets, GPU0)
    assert drv.events == [("open", a.data_ptr())]  # no copy (the first segment stays mapped: it is kept)
    assert all(int(t.sum()) == 0 for t in targets.tensors)


def test_a_read_without_copy_maps_every_segment_and_the_next_read_reuses_them(fake_cuda):
    drv = fake_cuda
    pool, slots = drv.alloc(4096), drv.alloc(4096)
    tensors = [_view(pool, 0, 128), _view(slots, 0, 128)]
    part = _part(drv, [pool, slots], tensors)
    reader = CudaIpcReader()
    assert reader.read(part, _targets(tensors), GPU0, copy=False).opened == 2  # mapped, nothing copied
    assert sorted(drv.open) == sorted([pool.data_ptr(), slots.data_ptr()])
    assert ("copy", "batch") not in drv.events
    res = reader.read(part, _targets(tensors), GPU0)
    assert (res.opened, res.reused) == (0, 2) and drv.calls["ipc_close"] == 0


def test_the_mappings_of_a_sender_that_exited_are_closed_within_seconds(fake_cuda):
    """A trainer killed while the rank maps its memory: the reader's watch
    closes the mapping (an exited process not yet reaped counts as gone)."""
    drv = fake_cuda
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: cma.proc_stat_fields(f"/proc/{child.pid}/stat")[0] == b"Z", 30, 0.01,
               "the child to exit (a zombie: not reaped yet)")
    assert not cma.pid_alive(child.pid)
    reader = CudaIpcReader()
    seg = drv.alloc(4096)
    alive = drv.alloc(4096)
    reader.read(_part(drv, [alive], [_view(alive, 0, 64)], sender="alive"), _targets([_view(alive, 0, 64)]), GPU0)
    reader.read(_part(drv, [seg], [_view(seg, 0, 64)], sender="killed", pid=child.pid),
                _targets([_view(seg, 0, 64)]), GPU0)
    wait_until(lambda: seg.data_ptr() not in drv.open, 30, 0.05, "the watch to close the dead sender's mapping")
    assert list(drv.open) == [alive.data_ptr()] and reader.stats()["kept_senders"] == 1
    child.wait()


def test_release_closes_the_kept_mappings_of_one_sender_of_gone_senders_or_of_all(fake_cuda):
    drv = fake_cuda
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)  # a process that exited (and was reaped)
    reader = CudaIpcReader()
    segs = {}
    for sender, pid in (("alive-1", os.getpid()), ("alive-2", os.getpid()), ("exited", dead_pid)):
        seg = segs[sender] = drv.alloc(4096)
        t = [_view(seg, 0, 64)]
        reader.read(_part(drv, [seg], t, sender=sender, pid=pid), _targets(t), GPU0)
    assert reader.stats()["kept_senders"] == 3

    assert reader.release(gone_only=True) == 1
    assert set(drv.open) == {segs["alive-1"].data_ptr(), segs["alive-2"].data_ptr()}
    assert reader.release(gone_only=True) == 0
    assert reader.release("alive-1") == 1 and set(drv.open) == {segs["alive-2"].data_ptr()}
    assert reader.release("nobody") == 0
    assert reader.release() == 1 and drv.open == {} and reader.stats()["kept_mappings"] == 0
    assert drv.calls["push"] == drv.calls["pop"]


def test_a_reader_keeps_mappings_of_a_few_senders_and_lets_the_oldest_go(fake_cuda):
    drv = fake_cuda
    reader = CudaIpcReader()
    segs = []
    for i in range(CudaIpcReader.max_kept_senders + 1):
        seg = drv.alloc(4096)
        segs.append(seg)
        t = [_view(seg, 0, 64)]
        reader.read(_part(drv, [seg], t, sender=f"trainer-{i}"), _targets(t), GPU0)
    assert reader.stats()["kept_senders"] == CudaIpcReader.max_kept_senders
    assert set(drv.open) == {s.data_ptr() for s in segs[1:]}  # the first sender's went


def test_on_one_gpu_without_the_copy_kernel_tensors_are_copied_one_by_one(fake_cuda):
    drv = fake_cuda
    seg, tensors, _ = _sender_tensors(drv)
    part = _part(drv, [seg], tensors, gpu=LOCAL_GPU)  # the reader's own GPU
    reader = CudaIpcReader()
    for _ in range(2):
        targets = _targets(tensors)
        assert reader.read(part, targets, GPU0).method == "ce"
        assert all(torch.equal(d, s) for d, s in zip(targets.tensors, tensors))
    assert drv.calls["copy_kernel"] == 1  # tried once, remembered
    assert drv.calls["memcpy_async"] == 4 and drv.calls["memcpy_batch"] == 0


def test_between_gpus_a_refused_batch_falls_back_to_one_copy_per_tensor(fake_cuda, monkeypatch):
    drv = fake_cuda

    def refused(*args):
        raise CudaDriverError("cuMemcpyBatchAsync", -1, "not in this driver")

    monkeypatch.setattr(cuda_driver, "memcpy_batch", refused)
    seg, tensors, part = _sender_tensors(drv)
    targets = _targets(tensors)
    assert CudaIpcReader().read(part, targets, GPU0).method == "ce"
    assert all(torch.equal(d, s) for d, s in zip(targets.tensors, tensors))
    assert drv.calls["memcpy_async"] == 2


def test_a_reader_says_why_it_cannot_read_a_part(fake_cuda, monkeypatch):
    drv = fake_cuda
    _, _, part = _sender_tensors(drv)
    reader = CudaIpcReader()
    assert reader.unusable(part, GPU0, "node-a") is None
    assert reader.unusable(part, GPU0, "node-b") == "the sender is on another node"
    assert reader.unusable(part, torch.device("cpu"), "node-a") == "target buffers on cpu"
    hidden = IpcPart(**{**part.__dict__, "device_uuid": "GPU-elsewhere"})
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1" in reader.unusable(hidden, GPU0, "node-a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reader.unusable(part, GPU0, "node-a") == "no CUDA device in this process"


# --------------------------------------------------------------------------- #
# The copy kernel's table
# --------------------------------------------------------------------------- #
def test_copy_rows_give_every_copy_the_index_of_its_first_chunk():
    rows, nchunks = copy_rows([1000, 9000, 20000], [50000, 60000, 70000], [250, 0, 100], chunk=100)
    assert rows.dtype == np.uint64
    assert rows.reshape(-1, 4).tolist() == [
        [1000, 50000, 250, 0],  # chunks 0, 1, 2 (2.5 chunks)
        [9000, 60000, 0, 3],  # none
        [20000, 70000, 100, 3],  # chunk 3: exactly one
    ]
    assert nchunks == 4
    again, n = copy_rows(np.array([1000, 9000, 20000], np.int64), np.array([50000, 60000, 70000], np.int64),
                         np.array([250, 0, 100], np.int64), chunk=100)
    assert again.tolist() == rows.tolist() and n == 4
    empty, n = copy_rows([], [], [], chunk=100)
    assert empty.size == 0 and n == 0


def test_copy_rows_number_the_chunks_of_every_copy_back_to_back_at_the_default_chunk_size():
    nbytes = [3 * MiB + 17, 1, MiB, 0, cuda_driver.CHUNK_BYTES]
    rows, nchunks = copy_rows([1 << 40] * 5, [2 << 40] * 5, nbytes)
    first = rows.reshape(-1, 4)[:, 3].astype(np.int64)
    per_copy = [-(-n // cuda_driver.CHUNK_BYTES) for n in nbytes]  # 13, 1, 4, 0, 1
    assert per_copy == [13, 1, 4, 0, 1]
    assert first.tolist() == [0, 13, 14, 18, 18] and nchunks == 19


# --------------------------------------------------------------------------- #
# The strided kernel's rows
# --------------------------------------------------------------------------- #
def _as_the_kernel_reads(rows, source: np.ndarray, n: int, esize: int) -> np.ndarray:
    """What the strided kernel writes, computed here: element (r, c) of a row read at
    ``src + (r * sR + c * sC) * esize`` and written at ``dst + (r * C + c) * esize`` (addresses are offsets)."""
    out = np.full(n, -1, np.int64)
    for dst, src, r, c, sr, sc, e in rows:
        assert e == esize and dst % e == 0 and src % e == 0
        rr, cc = np.meshgrid(np.arange(r), np.arange(c), indexing="ij")
        out[dst // e + rr * c + cc] = source[src // e + rr * sr + cc * sc]
    return out


@pytest.mark.parametrize("make, blocks", [
    (lambda b: b[:6000].view(100, 60).t(), 1),  # a transpose
    (lambda b: b[:6000].view(100, 60)[:, 7:40], 1),  # a column slice
    (lambda b: b[:8192][::2], 1),  # 1-D, a multiple of 32: 32 columns
    (lambda b: b[:3003][::3], 1),  # 1-D otherwise: one row
    (lambda b: b[:5 * 48 * 33].view(5, 48, 33).transpose(1, 2), 5),  # experts: a 2-D block each
    (lambda b: b[:3 * 4 * 17 * 9].view(3, 4, 17, 9).permute(2, 0, 3, 1), 17 * 3),
    (lambda b: b[:6000].view(10, 20, 30)[:, :, ::2], 1),  # the two leading dimensions merge
    (lambda b: b[5:75].view(1, 70).expand(40, 70), 1),  # stride 0
    (lambda b: b[:40].view(2, 20)[:, :1].view(2, 1).expand(2, 1), 1),
], ids=["transpose", "slice", "every_other", "every_third", "experts", "permuted_4d", "merged", "expand", "size1"])
def test_strided_rows_read_every_view_in_row_major_order(make, blocks):
    base = torch.arange(20000, dtype=torch.int32)
    v = make(base)
    rows = cuda_driver.strided_rows(4096, v.storage_offset() * 4, v.shape, v.stride(), 4)
    assert len(rows) == blocks
    got = _as_the_kernel_reads([(d - 4096, *rest) for d, *rest in rows], base.numpy().astype(np.int64),
                               v.numel(), 4)
    assert got.tolist() == v.contiguous().view(-1).tolist()


def test_strided_rows_refuse_a_view_of_more_blocks_than_allowed():
    v = torch.arange(4 * 50 * 6, dtype=torch.int16).view(4, 50, 6).permute(1, 0, 2)  # 50 blocks of 4 x 6
    assert cuda_driver.strided_rows(0, 0, v.shape, v.stride(), 2, max_blocks=49) is None
    assert len(cuda_driver.strided_rows(0, 0, v.shape, v.stride(), 2, max_blocks=50)) == 50
