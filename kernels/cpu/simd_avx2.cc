// AVX2 instantiation of the CPU optimizer kernels. Only called after cpuid says the CPU and the
// OS support AVX2 (optimizer_cpu.cc). No FMA: the oracle multiplies and adds separately.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/optimizer.h"

#pragma GCC push_options
#pragma GCC target("avx2")

#include "kernels/cpu/optimizer_cpu_impl.h"

namespace stallfree {
namespace kernels {
namespace cpu {
namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kMaxW = 8;
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  // A store never read back by the pass (the fp32 parameter slot): non-temporal where aligned
  // (Fence() orders them at the end of the chunk).
  static void StoreStream(float* p, F x) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_ps(p, x);
    else _mm256_storeu_ps(p, x);
  }
  static F Set1(float x) { return _mm256_set1_ps(x); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Abs(F a) {
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7fffffff)));
  }
  static void Fence() { _mm_sfence(); }
  static F LoadBf16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void StoreBf16(uint16_t* p, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan =
        _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, nan);
    // Values are < 2^16, so the unsigned-saturating pack is exact; it interleaves 128-bit
    // lanes, which the 64-bit permute puts back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

}  // namespace

const ChunkFns* Avx2Fns() {
  static const ChunkFns fns = MakeChunkFns<Avx2>("avx2");
  return &fns;
}

}  // namespace cpu
}  // namespace kernels
}  // namespace stallfree

#pragma GCC pop_options
