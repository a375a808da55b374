// Byte-moving scatter/gather between DRAM slots (mapped pinned host memory) and a paged KV pool.
//
// One kernel pair serves both pool layouts (see kvtier/transfer.py, "Slot layout contract"):
//   (a) layered: chunk c = 2*layer + {0: K, 1: V}; n_chunks = 2*layers separate pool tensors;
//   (b) contiguous: n_chunks = 1; the chunk is the whole block.
// A slot holds its chunks back to back: chunk c lives at slot_base + c*chunk_bytes.
// A pool chunk of block b lives at bases[c] + b*block_stride.
//
// Work is split into (pair, chunk, tile) items; a thread block copies one tile at a time with
// 16-byte (uint4) loads/stores when source and destination are 16-byte aligned, else byte by byte.
// The kernels do not know dtypes: they move bytes. Duplicate destinations are rejected on the host.

#ifndef KV_THREADS
#define KV_THREADS 256
#endif
#define KV_UNROLL 4

typedef unsigned long long kv_u64;

__device__ __forceinline__ void kv_copy_tile(unsigned char* __restrict__ dst,
                                             const unsigned char* __restrict__ src,
                                             long long n) {
    if (((reinterpret_cast<kv_u64>(dst) | reinterpret_cast<kv_u64>(src)) & 15ULL) == 0ULL) {
        const long long nv = n >> 4;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        long long i = threadIdx.x;
        for (; i + (KV_UNROLL - 1) * KV_THREADS < nv; i += KV_UNROLL * KV_THREADS) {
            uint4 r[KV_UNROLL];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) r[u] = s[i + u * KV_THREADS];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) d[i + u * KV_THREADS] = r[u];
        }
        for (; i < nv; i += KV_THREADS) d[i] = s[i];
        for (long long j = (nv << 4) + threadIdx.x; j < n; j += KV_THREADS) dst[j] = src[j];
    } else {
        for (long long j = threadIdx.x; j < n; j += KV_THREADS) dst[j] = src[j];
    }
}

template <bool kScatter>
__device__ __forceinline__ void kv_copy_blocks(unsigned char* slots, long long slot_stride,
                                               unsigned char* const* __restrict__ bases,
                                               long long block_stride, long long chunk_bytes,
                                               int n_chunks, const long long* __restrict__ pairs,
                                               long long n_pairs, long long tile_bytes) {
    const long long tiles = (chunk_bytes + tile_bytes - 1) / tile_bytes;
    const long long items = n_pairs * n_chunks * tiles;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        const long long t = w % tiles;
        const long long pc = w / tiles;
        const int c = static_cast<int>(pc % n_chunks);
        const long long p = pc / n_chunks;
        const long long slot = pairs[2 * p];
        const long long block = pairs[2 * p + 1];
        const long long start = t * tile_bytes;
        const long long rest = chunk_bytes - start;
        const long long n = rest < tile_bytes ? rest : tile_bytes;
        unsigned char* host = slots + slot * slot_stride + c * chunk_bytes + start;
        unsigned char* dev = bases[c] + block * block_stride + start;
        if (kScatter) {
            kv_copy_tile(dev, host, n);
        } else {
            kv_copy_tile(host, dev, n);
        }
    }
}

// Load: slots -> pool. pairs is [n_pairs][2] int64 (slot, pool block); pool blocks are distinct.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kv_scatter(unsigned char* slots, long long slot_stride, unsigned char* const* bases,
           long long block_stride, long long chunk_bytes, int n_chunks, const long long* pairs,
           long long n_pairs, long long tile_bytes) {
    kv_copy_blocks<true>(slots, slot_stride, bases, block_stride, chunk_bytes, n_chunks, pairs,
                         n_pairs, tile_bytes);
}

// Store: pool -> slots. pairs is [n_pairs][2] int64 (slot, pool block); slots are distinct.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kv_gather(unsigned char* slots, long long slot_stride, unsigned char* const* bases,
          long long block_stride, long long chunk_bytes, int n_chunks, const long long* pairs,
          long long n_pairs, long long tile_bytes) {
    kv_copy_blocks<false>(slots, slot_stride, bases, block_stride, chunk_bytes, n_chunks, pairs,
                          n_pairs, tile_bytes);
}
