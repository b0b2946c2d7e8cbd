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


def _views(dtype):
    """Non-contiguous views of ``dtype`` the ways trainers make them, each of its own storage."""
    def base(*shape):
        n = int(np.prod(shape))
        return torch.arange(n, device="cuda").to(torch.int64).remainder(251).to(dtype).view(shape) \
            if dtype != torch.float32 else torch.randn(shape, device="cuda", dtype=dtype)

    return {
        "transpose": base(300, 77).t(),  # rows of the view are the source's columns
        "transpose_square": base(64, 64).t(),
        "column_slice": base(130, 100)[:, 3:61],  # a fused q/k/v weight's part
        "row_and_column_step": base(99, 80)[::3, ::2],
        "every_other": base(2 * 4096)[::2],  # 1-D, a multiple of 32
        "every_third_odd": base(3 * 1001)[::3],  # 1-D, not a multiple of 32
        "experts_transposed": base(5, 48, 33).transpose(1, 2),  # (E, in, out) of (E, out, in): 2-D blocks
        "permuted_4d": base(3, 4, 17, 9).permute(2, 0, 3, 1),
        "expanded": base(1, 70).expand(40, 70),  # stride 0
        "narrow_tall": base(5000, 3)[:, 1],
        "tiny": base(2, 2).t(),
    }


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_the_strided_kernel_lays_out_non_contiguous_views_row_major_bit_for_bit(dtype):
    views = _views(dtype)
    assert not any(v.is_contiguous() for v in views.values())
    total = sum(v.nbytes for v in views.values())
    slot = torch.full((total + 64,), 0xAB, dtype=torch.uint8, device="cuda")
    rows, at, where = [], 0, {}
    for name, v in views.items():
        r = cuda_driver.strided_rows(slot.data_ptr() + at, v.data_ptr(), v.shape, v.stride(), v.element_size())
        assert r is not None, name
        rows += r
        where[name] = at
        at += v.nbytes
    torch.cuda.synchronize()
    cuda_driver.copy_kernel(0).strided(rows)
    torch.cuda.synchronize()
    for name, v in views.items():
        got = slot[where[name]:where[name] + v.nbytes]
        assert torch.equal(got, v.contiguous().view(-1).view(torch.uint8)), name
    assert torch.equal(slot[total:], torch.full((64,), 0xAB, dtype=torch.uint8, device="cuda"))  # nothing beyond
