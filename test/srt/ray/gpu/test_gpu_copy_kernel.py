"""The SM copy kernel and its table, made on the GPU (rdt/transport/cuda_driver.py).

GPU only: skipped where ``torch.cuda.is_available()`` is false, and not part
of ``make test`` (run it on a CUDA machine with
``python -m pytest test/srt/ray/gpu``).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU test: needs a CUDA device (the copy kernel); torch.cuda.is_available() is False here",
                allow_module_level=True)

import numpy as np  # noqa: E402

from sglang.srt.ray.rdt.transport import cuda_driver  # noqa: E402

CHUNK = cuda_driver.CHUNK_BYTES
# 0 bytes, 1 byte, one chunk and a byte, exactly one chunk, 40 chunks and a few
# bytes (more chunks than a warp has threads), an odd size
SIZES = [0, 1, CHUNK + 1, CHUNK, 40 * CHUNK + 7, 3 * 1024 * 1024 + 17]


def chunks_of(dst, src, nbytes, same_dst=False):
    """Each copy's chunks as the kernel must read them: ``[(dst, src, len)]``."""
    out = []
    for d, s, n in zip(dst, src, nbytes):
        for off in range(0, n, CHUNK):
            out.append((d if same_dst else d + off, s + off, min(CHUNK, n - off)))
    return out


@pytest.mark.parametrize("same_dst", [False, True])
def test_the_table_made_on_the_gpu_holds_every_chunk_of_every_copy_in_order(same_dst):
    kernel = cuda_driver.copy_kernel(0)
    dst = [(1 << 40) + i * (1 << 32) for i in range(len(SIZES))]
    src = [(3 << 40) + i * (1 << 32) + 16 * i for i in range(len(SIZES))]
    table = kernel.table(np.array(dst, np.int64), np.array(src, np.int64), np.array(SIZES, np.int64),
                         same_dst=same_dst)
    rows = [tuple(r) for r in table.view(-1, 3).cpu().numpy().astype(np.uint64).tolist()]
    assert rows == chunks_of(dst, src, SIZES, same_dst)


def _copy(dst, src):
    from sglang.srt.ray.rdt.transport.metadata import addresses

    d, n = addresses(dst)
    cuda_driver.copy_ptrs(0, d, addresses(src)[0], n)
    torch.cuda.synchronize()


def test_copy_ptrs_copies_every_byte_of_odd_sizes_and_offsets_with_one_table():
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randint(0, 256, (sum(SIZES) + 64 * len(SIZES),), dtype=torch.uint8, device="cuda",
                         generator=g)
    src, at = [], 0
    for i, n in enumerate(SIZES):
        at += i % 3  # some sources start off any alignment
        src.append(pool[at:at + n])
        at += n
    dst = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in SIZES]
    _copy(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    # thousands of copies in one table (an MoE model's experts)
    many_src = [pool[i * 517:i * 517 + 4099] for i in range(3000)]
    many_dst = [torch.zeros(4099, dtype=torch.uint8, device="cuda") for _ in range(3000)]
    _copy(many_dst, many_src)
    assert all(torch.equal(d, s) for d, s in zip(many_dst, many_src))


def test_a_table_is_made_without_waiting_for_the_work_queued_before_it():
    kernel = cuda_driver.copy_kernel(0)
    stream = torch.cuda.current_stream(0)
    dst, src = [1 << 40, 2 << 40], [3 << 40, 4 << 40]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a kernel that keeps the stream busy for about a second
    table = kernel.table(np.array(dst, np.int64), np.array(src, np.int64), np.array([CHUNK + 5, 9], np.int64))
    assert not stream.query(), "table() waited for the stream to drain"
    rows = [tuple(r) for r in table.view(-1, 3).cpu().numpy().astype(np.uint64).tolist()]
    assert rows == chunks_of(dst, src, [CHUNK + 5, 9])
