// Warp-level tensor-core and async-copy primitives (sm_80 and later), shared by every
// mma.sync kernel: ldmatrix, mma.sync m16n8k16 with f32 accumulation, cp.async, packing.
//
// Fragment layouts are PTX's (ISA "Matrix fragments for mma.m16n8k16"): for a lane l,
// group g = l / 4 and thread t = l % 4,
//   A (16x16, row major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16x8, col major):  b[0] = (2t..2t+1, g),  b[1] = (2t+8.., g)
//   C (16x8, f32):        c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

namespace ejk::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem_row)));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem_row)));
}

// Two 8x8 matrices; lanes 0..15 give the row addresses.
__device__ __forceinline__ void LdMatrixX2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SharedAddress(smem_row)));
}

__device__ __forceinline__ void LdMatrixX2Trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SharedAddress(smem_row)));
}

// d += a * b for one 16x8x16 tile; Element is __nv_bfloat16 or __half.
template <typename Element>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as one register of two 16-bit values (lo in the low half), round to nearest.
template <typename Element>
__device__ __forceinline__ uint32_t PackFloat2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t PackFloat2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t PackFloat2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Dot product of two rows of eight 16-bit values (16 bytes each), accumulated in float in
// element order.
template <typename Element>
__device__ __forceinline__ float Dot8(const uint4& x, const uint4& y) {
  const Element* a = reinterpret_cast<const Element*>(&x);
  const Element* b = reinterpret_cast<const Element*>(&y);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) sum = fmaf(static_cast<float>(a[e]), static_cast<float>(b[e]), sum);
  return sum;
}

// 16-byte global -> shared copy that bypasses L1; when !valid the destination is zero-filled
// and the source is not read.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(smem)), "l"(gmem),
               "r"(src_bytes));
}

// L2 policy for data read once: its lines are evicted first, so a stream larger than L2
// does not push out what the next kernels reuse (code, metadata, small operands).
__device__ __forceinline__ uint64_t L2EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// CpAsync16 under an L2 cache policy (from createpolicy, e.g. L2EvictFirstPolicy).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid, uint64_t l2_policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(SharedAddress(smem)),
               "l"(gmem), "r"(src_bytes), "l"(l2_policy));
}

// Programmatic dependent launch (sm_90 and later). A kernel started by LaunchAfterPrevious
// may begin while the kernel before it in the stream is still running; it must call
// WaitForPreviousGrid before it touches memory that kernel writes (the wait returns once the
// previous grid has completed and its writes are visible). Work before that kernel, if it
// was launched normally, had completed when it started. A kernel calls AllowDependentLaunch
// to let the next such kernel launch (its blocks then take SMs as this grid's blocks exit).
// Elsewhere both are no-ops and the launch is an ordinary one.
__device__ __forceinline__ void WaitForPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches `kernel` with programmatic stream serialisation when `programmatic` (the caller
// checks ProgrammaticLaunchRuns: the code the device runs must hold the waits), else as an
// ordinary launch.
template <typename... Params, typename... Args>
cudaError_t LaunchAfterPrevious(bool programmatic, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Butterfly reductions over the lanes that differ only in the bits below 2 * first_offset:
// first_offset 2 reduces over a quad (the 4 lanes sharing a fragment row), 16 over the warp.
__device__ __forceinline__ float LaneReduceMax(float x, int first_offset) {
  for (int offset = first_offset; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float LaneReduceSum(float x, int first_offset) {
  for (int offset = first_offset; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace ejk::cuda
