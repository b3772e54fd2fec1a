// The warp-level tensor-core building blocks of hierpar's CUDA kernels (sm_80+ PTX): 16-byte asynchronous copies,
// ldmatrix, and mma.sync for bf16 / fp16 (m16n8k16) and TF32 (m16n8k8), all with fp32 accumulation; and, for sm_90a
// code, wgmma (bf16 / fp16, operands in shared memory) and TMA tile loads.
// Code for sm_75 (the oldest architecture torch supports) has no cp.async, TF32 or m16n8k16: there these helpers
// compile to a trap, and the host never launches a kernel that uses them (DeviceCaps::ampere_instructions()).
// Private to hierpar_ops.
#pragma once

#include "cuda/arch_guard.cuh"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace hierpar::detail::mma {

__device__ inline uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy; with `pred` false nothing is read and the 16 bytes are zero-filled.
__device__ inline void cp_async16(void* dst, const void* src, bool pred) {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
#endif
}
__device__ inline void cp_async_commit() {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ inline void cp_async_wait() {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Four 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ inline uint32_t to_tf32(uint32_t bits) {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
  return bits;
#else
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(bits)));
  return r;
#endif
}

// d += a * b on one 16 x 8 tile (K = 16 for 16-bit, 8 for TF32). Fragments as the PTX ISA lays them out:
// lane = 4 * g + t4 holds A rows g and g + 8 at K columns 2 * t4 (+1) and 2 * t4 + 8 (+1), B column g at the
// same K rows, and C rows g, g + 8 at columns 2 * t4, 2 * t4 + 1.
template <typename scalar_t>
__device__ inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<scalar_t, float>, "mma: bf16, fp16 or fp32 (as TF32)");
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// ---- sm_90a only: warpgroup MMAs (wgmma) with both operands read from shared memory ----------------------
// Compiled where the architecture-specific features exist (nvcc -gencode arch=compute_90a); callers guard
// their kernels' bodies with the same macro.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of a K-major operand tile in shared memory with the 128-byte swizzle: rows of 64 16-bit elements
// (128 bytes), 16-byte chunk c of row r stored at chunk c ^ (r % 8), 8-row atoms of 1024 bytes (the stride
// between 8-row groups, SBO), atoms 1024-byte aligned. The leading-byte offset is unused for swizzled K-major
// tiles (1 by convention). Stepping K by 16 elements inside the atom adds 32 bytes to the start address.
__device__ inline uint64_t wgmma_desc_k_sw128(uint32_t smem_byte_addr) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
// Descriptor of an M-/N-major operand tile with the 128-byte swizzle: per 64-element block of M / N, one
// 128-byte row per K-element (chunk c of row k at c ^ (k % 8)), 8-row groups 1024 bytes apart (SBO), the blocks
// `block_bytes` apart (LBO). Stepping K by 16 rows adds 2048 bytes to the start address.
__device__ inline uint64_t wgmma_desc_mn_sw128(uint32_t smem_byte_addr, uint32_t block_bytes) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t(block_bytes >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async included, once waited for) visible to the
// async proxy that wgmma reads through; a barrier then publishes them to the warpgroups.
__device__ inline void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Tensor-memory-accelerator (TMA) loads into shared memory, completed on an mbarrier: one thread arms the
// barrier with the bytes to expect and issues the copies; the consumers wait for the barrier's phase to flip.
// Boxes are addressed by signed element coordinates (innermost dimension first); elements outside the tensor
// are written as zeros. `tmap` is the generic address of a CUtensorMap kernel parameter (__grid_constant__).
__device__ inline void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes the initialised barriers visible to the async proxy (the TMA unit) before the first copy names them.
__device__ inline void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ inline void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ inline void tma_load_2d(uint32_t dst, const void* tmap, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ inline void tma_load_3d(uint32_t dst, const void* tmap, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ inline void tma_load_4d(uint32_t dst, const void* tmap, int c0, int c1, int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The PTX of one wgmma.mma_async.sync.aligned.m64n<N>k16 with fp32 accumulators and operand type `ab` (f16 or
// bf16): operands are the N / 2 accumulators, desc-a, desc-b, scale-d (a register, tested into p), imm-trans-a,
// imm-trans-b.
#define HIERPAR_WGMMA_M64N32K16(ab) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n32k16.f32." ab "." ab " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
#define HIERPAR_WGMMA_M64N64K16(ab) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." ab "." ab " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
#define HIERPAR_WGMMA_M64N128K16(ab) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." ab "." ab " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
// Sixteen accumulator operands, d[o] to d[o + 15].
#define HIERPAR_WGMMA_ACC16(d, o) \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15])
// One wgmma of TEXT (one of the macros above) for fp16 (kF16) or bf16 operands; the accumulator operands follow.
#define HIERPAR_WGMMA(kF16, TEXT, desc_a, desc_b, trans_a, trans_b, ...)                                        \
  do {                                                                                                            \
    if constexpr (kF16)                                                                                           \
      asm volatile(TEXT("f16") : __VA_ARGS__ : "l"(desc_a), "l"(desc_b), "r"(1), "n"(trans_a), "n"(trans_b));     \
    else                                                                                                          \
      asm volatile(TEXT("bf16") : __VA_ARGS__ : "l"(desc_a), "l"(desc_b), "r"(1), "n"(trans_a), "n"(trans_b));    \
  } while (0)

// d[64 x N] += A[64 x 16] * B[16 x N] for one warpgroup, both K-major (tnsp 0), fp32 accumulators laid out as
// mma.sync's C fragment repeated per 8 columns: d[4j + e] is row 16 * (warp % 4) + g (+ 8 for e >= 2), column
// 8j + 2 * t4 (+ 1 for odd e), with g = lane / 4, t4 = lane % 4. kF16: fp16 operands, else bf16.
// kTransB = 1 (n128, n64): B N-major in shared memory instead (imm-trans-b; see wgmma_desc_mn_sw128).
template <bool kF16, int kTransB = 0>
__device__ inline void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N128K16, desc_a, desc_b, 0, kTransB, HIERPAR_WGMMA_ACC16(d, 0),
                HIERPAR_WGMMA_ACC16(d, 16), HIERPAR_WGMMA_ACC16(d, 32), HIERPAR_WGMMA_ACC16(d, 48));
}
template <bool kF16, int kTransB = 0>
__device__ inline void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N64K16, desc_a, desc_b, 0, kTransB, HIERPAR_WGMMA_ACC16(d, 0),
                HIERPAR_WGMMA_ACC16(d, 16));
}
template <bool kF16>
__device__ inline void wgmma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N32K16, desc_a, desc_b, 0, 0, HIERPAR_WGMMA_ACC16(d, 0));
}
// The same with both operands M- / N-major in shared memory (imm-trans-a = imm-trans-b = 1).
template <bool kF16>
__device__ inline void wgmma_m64n128k16_tt(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N128K16, desc_a, desc_b, 1, 1, HIERPAR_WGMMA_ACC16(d, 0),
                HIERPAR_WGMMA_ACC16(d, 16), HIERPAR_WGMMA_ACC16(d, 32), HIERPAR_WGMMA_ACC16(d, 48));
}
template <bool kF16>
__device__ inline void wgmma_m64n64k16_tt(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N64K16, desc_a, desc_b, 1, 1, HIERPAR_WGMMA_ACC16(d, 0),
                HIERPAR_WGMMA_ACC16(d, 16));
}
// The same (K-major operands) with the accumulators as 1, 2 or 4 blocks of 32 columns (16 registers each),
// for kernels whose 32-column output groups are used in different combinations.
template <bool kF16>
__device__ inline void wgmma_m64n32k16_blocks(float (&d0)[16], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N32K16, desc_a, desc_b, 0, 0, HIERPAR_WGMMA_ACC16(d0, 0));
}
template <bool kF16>
__device__ inline void wgmma_m64n64k16_blocks(float (&d0)[16], float (&d1)[16], uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N64K16, desc_a, desc_b, 0, 0, HIERPAR_WGMMA_ACC16(d0, 0),
                HIERPAR_WGMMA_ACC16(d1, 0));
}
template <bool kF16>
__device__ inline void wgmma_m64n128k16_blocks(float (&d0)[16], float (&d1)[16], float (&d2)[16], float (&d3)[16],
                                               uint64_t desc_a, uint64_t desc_b) {
  HIERPAR_WGMMA(kF16, HIERPAR_WGMMA_M64N128K16, desc_a, desc_b, 0, 0, HIERPAR_WGMMA_ACC16(d0, 0),
                HIERPAR_WGMMA_ACC16(d1, 0), HIERPAR_WGMMA_ACC16(d2, 0), HIERPAR_WGMMA_ACC16(d3, 0));
}
#undef HIERPAR_WGMMA
#undef HIERPAR_WGMMA_ACC16
#undef HIERPAR_WGMMA_M64N128K16
#undef HIERPAR_WGMMA_M64N64K16
#undef HIERPAR_WGMMA_M64N32K16
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace hierpar::detail::mma
