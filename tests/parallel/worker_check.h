// Checks shared by the parallel layer workers (run as ranks by the tests): failure macros that
// print the rank and return false, seeded normal data, and the tolerance comparison.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stallfree {
namespace testing {

inline int g_rank = 0;  // this process's rank, for messages

#define CHECK_OR_FAIL(cond, ...)                                                               \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "FAIL rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   absl::StrCat(__VA_ARGS__).c_str());                                         \
      return false;                                                                            \
    }                                                                                          \
  } while (0)

#define CHECK_OK(expr, what)                           \
  do {                                                 \
    absl::Status s_ = (expr);                          \
    CHECK_OR_FAIL(s_.ok(), what, ": ", s_.ToString()); \
  } while (0)

inline constexpr double kRelTol = 1e-5;
inline constexpr double kAbsTol = 1e-7;

inline std::vector<float> RandomNormal(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const double u1 = (static_cast<double>(rng()) + 1.0) / 4294967296.0;
    const double u2 = static_cast<double>(rng()) / 4294967296.0;
    x = static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
  return v;
}

// got [n] against ref [n] with ref_max = max|ref tensor|.
inline bool Compare(const std::string& what, const float* got, const float* ref, int64_t n,
             double ref_max) {
  const double tol = kRelTol * ref_max + kAbsTol;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    CHECK_OR_FAIL(err <= tol, what, " [", i, "] = ", got[i], ", reference ", ref[i], " (err ", err,
                  " > tol ", tol, ")");
    worst = std::max(worst, err);
  }
  std::printf("  %-8s max err %.3g (tol %.3g, max|ref| %.3g)\n", what.c_str(), worst, tol, ref_max);
  return true;
}

inline double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

inline int64_t BlockSize(int64_t n, int d, int b) { return n / d + (b < n % d ? 1 : 0); }

}  // namespace testing
}  // namespace stallfree
