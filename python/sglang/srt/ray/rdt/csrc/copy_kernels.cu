// The copy kernels of RDT weight sync's same-node GPU path. Compiled with NVRTC
// on first use and loaded through the CUDA driver by
// sglang/srt/ray/rdt/transport/cuda_driver.py (CopyKernel): no build step.

// Every chunk of a table of (dst, src, nbytes) rows, 16 bytes per thread
// where both ends are 16-byte aligned.
extern "C" __global__ void __launch_bounds__(512)
sglang_rdt_copy(const unsigned long long* __restrict__ tab, const int nchunks) {
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        unsigned char* dst = (unsigned char*)tab[3 * c];
        const unsigned char* src = (const unsigned char*)tab[3 * c + 1];
        const unsigned long long n = tab[3 * c + 2];
        const bool aligned = ((((unsigned long long)dst) | ((unsigned long long)src)) & 15ULL) == 0ULL;
        const unsigned long long nv = aligned ? (n >> 4) : 0ULL;
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        const unsigned long long b = blockDim.x;
        for (unsigned long long i = threadIdx.x; i < nv; i += 8ULL * b) {
            uint4 r[8];
            #pragma unroll
            for (int u = 0; u < 8; ++u) if (i + u * b < nv) r[u] = s4[i + u * b];
            #pragma unroll
            for (int u = 0; u < 8; ++u) if (i + u * b < nv) d4[i + u * b] = r[u];
        }
        for (unsigned long long i = (nv << 4) + threadIdx.x; i < n; i += b) dst[i] = src[i];
    }
}

// The copy kernel's table from one row (dst, src, nbytes, first chunk) per
// copy: a warp per copy writes its chunks' rows (every chunk's dst the row's
// own when same_dst is set).
extern "C" __global__ void
sglang_rdt_chunks(const unsigned long long* __restrict__ rows, const int n,
                  unsigned long long* __restrict__ tab, const unsigned long long chunk,
                  const int same_dst) {
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < n; t += warps) {
        const unsigned long long dst = rows[4 * t], src = rows[4 * t + 1], nbytes = rows[4 * t + 2];
        unsigned long long* out = tab + 3 * rows[4 * t + 3];
        for (unsigned long long c = lane; c * chunk < nbytes; c += 32) {
            const unsigned long long off = c * chunk, left = nbytes - off;
            out[3 * c] = same_dst ? dst : dst + off;
            out[3 * c + 1] = src + off;
            out[3 * c + 2] = left < chunk ? left : chunk;
        }
    }
}

// Non-contiguous views laid out row-major. One row per view:
// (dst, src, rows R, cols C, row stride sR, col stride sC, element bytes,
// first tile); strides in elements. Element (r, c) is read at
// src[r * sR + c * sC] and written at dst[r * C + c]. A block of 32 x 8
// threads copies a 32 x 32 tile at a time. Where a view's rows are its
// source's columns (sR == 1: a transpose), the tile goes through shared
// memory, so that reads and writes both run along memory.
template <typename T>
__device__ void strided_tile(const unsigned long long* row, const unsigned long long tile, T (*buf)[33]) {
    T* dst = (T*)row[0];
    const T* src = (const T*)row[1];
    const long long R = row[2], C = row[3], sR = row[4], sC = row[5];
    const long long across = (C + 31) / 32;
    const long long r0 = (long long)(tile / across) * 32, c0 = (long long)(tile % across) * 32;
    const int tx = threadIdx.x, ty = threadIdx.y;
    if (sR == 1 && sC != 1) {
        for (int k = ty; k < 32; k += 8) {
            if (r0 + tx < R && c0 + k < C) buf[k][tx] = src[(r0 + tx) + (c0 + k) * sC];
        }
        __syncthreads();
        for (int k = ty; k < 32; k += 8) {
            if (r0 + k < R && c0 + tx < C) dst[(r0 + k) * C + c0 + tx] = buf[tx][k];
        }
        __syncthreads();  // the tile is read before the next one lands
    } else {
        for (int k = ty; k < 32; k += 8) {
            const long long r = r0 + k, c = c0 + tx;
            if (r < R && c < C) dst[r * C + c] = src[r * sR + c * sC];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
sglang_rdt_strided(const unsigned long long* __restrict__ rows, const int n, const unsigned long long ntiles) {
    __shared__ unsigned long long smem[32 * 33];
    for (unsigned long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        int lo = 0, hi = n - 1;  // the last view whose first tile is at most t
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (rows[8 * mid + 7] <= t) lo = mid; else hi = mid - 1;
        }
        const unsigned long long* row = rows + 8 * lo;
        const unsigned long long tile = t - row[7];
        switch (row[6]) {  // the same for the whole block: its __syncthreads() are reached by all
            case 1: strided_tile<unsigned char>(row, tile, (unsigned char (*)[33])smem); break;
            case 2: strided_tile<unsigned short>(row, tile, (unsigned short (*)[33])smem); break;
            case 4: strided_tile<unsigned int>(row, tile, (unsigned int (*)[33])smem); break;
            default: strided_tile<unsigned long long>(row, tile, (unsigned long long (*)[33])smem); break;
        }
    }
}
