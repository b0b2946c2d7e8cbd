"""A rank's read that first waits for the sender's event (rdt/transport/cuda_ipc.py, ``ready``): the sender queues
its gather and sends the pull at once; the rank polls the sender's inter-process event before it copies.

GPU only: skipped where ``torch.cuda.is_available()`` is false, and not part
of ``make test`` (run it on a CUDA machine with
``python -m pytest test/srt/ray/gpu``). The sender is a child process on the
same GPU that queues a long sleep kernel, then the write, then its event.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU test: needs a CUDA device (an inter-process event); torch.cuda.is_available() is False here",
                allow_module_level=True)

import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from sglang.srt.ray.rdt.transport.cuda_ipc import CudaIpcReader  # noqa: E402
from sglang.srt.ray.rdt.transport.metadata import MappingFailed, Targets  # noqa: E402

NUMEL = 1 << 20
# The sender: 4 MiB of kept memory; a sleep of ``cycles`` queued, then a write of 7s, then its event recorded; it
# prints (its read description, the event's IPC handle). On a line on stdin: a sleep of 100x as long, a write of 8s,
# the event recorded again, and "again" printed; then it waits for another line.
SENDER = r"""
import pickle, sys
import numpy as np, torch
from sglang.srt.ray.rdt.transport.cuda_ipc import CudaIpcExporter
buf = torch.zeros(%d, dtype=torch.float32, device="cuda:0")
exporter = CudaIpcExporter("sender-under-test")
exporter.keep_registered(0, buf.untyped_storage().data_ptr())
part = exporter.export(np.array([buf.data_ptr()], np.int64), np.array([buf.nbytes], np.int64), 0, "node")
ev = torch.cuda.Event(interprocess=True)
torch.cuda.synchronize()
for value, cycles, say in ((7.0, int(sys.argv[1]), None), (8.0, 100 * int(sys.argv[1]), b"again")):
    torch.cuda._sleep(cycles)
    buf.fill_(value)
    ev.record()
    sys.stdout.buffer.write((say or pickle.dumps((part, ev.ipc_handle())).hex().encode()) + b"\n")
    sys.stdout.flush()
    sys.stdin.readline()
""" % NUMEL


def start_sender(cycles: int):
    proc = subprocess.Popen([sys.executable, "-c", SENDER, str(cycles)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    part, handle = pickle.loads(bytes.fromhex(proc.stdout.readline().decode()))
    return proc, part, handle


def targets():
    dst = torch.full((NUMEL,), -1.0, device="cuda:0")
    return dst, Targets.of([dst])


def test_a_read_waits_for_the_senders_event_before_it_copies():
    """The sender's write is queued behind ~a second of sleep when the rank
    reads: the rank copies the 7s written after the sleep, never the zeros
    before it."""
    proc, part, handle = start_sender(2_000_000_000)
    reader = CudaIpcReader()
    try:
        dst, tg = targets()
        res = reader.read(part, tg, torch.device("cuda:0"), ready=handle)
        torch.cuda.synchronize()
        assert res.bytes == NUMEL * 4 and torch.equal(dst, torch.full_like(dst, 7.0))
    finally:
        reader.release()
        proc.kill()  # (its next sleep is far longer than the test)
        proc.wait()


def test_a_read_whose_sender_dies_before_its_event_is_refused_and_copies_nothing():
    """A first read waits for the sender's event as above (and keeps its
    mapping and the event opened); then the sender queues a sleep far longer
    than the test, a write and its event again, and is killed while the
    sleep runs: the next read does not hang on the event and copies nothing;
    it says the sender's process exited (or that its event failed)."""
    proc, part, handle = start_sender(2_000_000_000)
    reader = CudaIpcReader()
    try:
        dst, tg = targets()
        reader.read(part, tg, torch.device("cuda:0"), ready=handle)
        torch.cuda.synchronize()
        assert torch.equal(dst, torch.full_like(dst, 7.0))
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"again\n"
        proc.kill()
        proc.wait()
        dst.fill_(-1.0)
        with pytest.raises(MappingFailed, match=r"the sender's bytes are not ready: .*"
                                                rf"(the sender's process \(pid {proc.pid}\) exited during its "
                                                r"gather|Error)"):
            reader.read(part, tg, torch.device("cuda:0"), ready=handle)
        torch.cuda.synchronize()
        assert torch.equal(dst, torch.full_like(dst, -1.0))
    finally:
        reader.release()
        if proc.poll() is None:
            proc.kill()
