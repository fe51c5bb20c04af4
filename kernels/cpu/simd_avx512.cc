// AVX-512 (F + BW) instantiation of the CPU optimizer kernels. Only called after cpuid says the
// CPU and the OS support AVX-512 (optimizer_cpu.cc).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/optimizer.h"

#pragma GCC push_options
// GCC 12 warns about the deliberately undefined pass-through operand inside its own
// _mm512_cvtepi32_epi16 (avx512fintrin.h); the warning is about the header, not this code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

#include "kernels/cpu/optimizer_cpu_impl.h"

namespace stallfree {
namespace kernels {
namespace cpu {
namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kMaxW = 16;
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  // A store never read back by the pass (the fp32 parameter slot): non-temporal where aligned,
  // skipping the read for ownership (Fence() orders them at the end of the chunk).
  static void StoreStream(float* p, F x) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) _mm512_stream_ps(p, x);
    else _mm512_storeu_ps(p, x);
  }
  static F Set1(float x) { return _mm512_set1_ps(x); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Abs(F a) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  }
  static void Fence() { _mm_sfence(); }
  static F LoadBf16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void StoreBf16(uint16_t* p, F x) {
    // Integer round to nearest even (VCVTNEPS2BF16 would flush denormals, unlike the oracle).
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet_nan);
    const __m256i packed = _mm512_cvtepi32_epi16(r);
    // The bf16 copy is written, never read back: non-temporal stores skip the read for
    // ownership of its cache lines (Fence() orders them at the end of the chunk).
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    }
  }
};

}  // namespace

const ChunkFns* Avx512Fns() {
  static const ChunkFns fns = MakeChunkFns<Avx512>("avx512");
  return &fns;
}

}  // namespace cpu
}  // namespace kernels
}  // namespace stallfree

#pragma GCC diagnostic pop
#pragma GCC pop_options
