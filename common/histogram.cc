#include "common/histogram.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace stallfree {

void Histogram::Render(const std::string& name, const std::string& help, std::string* out) const {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    const std::string le = i < bounds_.size() ? absl::StrFormat("%g", bounds_[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket{le=\"", le, "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_sum ", absl::StrFormat("%.9g", sum_.load()), "\n");
  // The count is the +Inf bucket's (read once above), so that they always agree.
  absl::StrAppend(out, name, "_count ", cumulative, "\n");
}

}  // namespace stallfree
