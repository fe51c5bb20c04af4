// Histogram: a Prometheus histogram (cumulative buckets, sum, count) that any thread may
// observe into without a lock. Render appends the text exposition format.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stallfree {

class Histogram {
 public:
  // bounds: the buckets' upper bounds, increasing; +Inf is added.
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
    for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
  }
  void Observe(double v) {
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    double old = sum_.load(std::memory_order_relaxed);
    while (!sum_.compare_exchange_weak(old, old + v, std::memory_order_relaxed)) {
    }
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  // # HELP / # TYPE, then name_bucket{labels,le="..."}, name_sum, name_count.
  void Render(const std::string& name, const std::string& help, std::string* out) const;

  // Exponential bounds: start, start * factor, ... (n of them).
  static std::vector<double> Exponential(double start, double factor, int n) {
    std::vector<double> b;
    for (int i = 0; i < n; ++i, start *= factor) b.push_back(start);
    return b;
  }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative; +Inf last
  std::atomic<double> sum_{0};
  std::atomic<uint64_t> count_{0};
};

}  // namespace stallfree
