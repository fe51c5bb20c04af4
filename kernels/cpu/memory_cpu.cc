#include "kernels/cpu/memory_cpu.h"

namespace stallfree {
namespace kernels {
namespace {

class CpuMemoryImpl final : public CpuMemoryOf<BackendMemory> {
 public:
  const char* name() const override { return "cpu"; }
};

}  // namespace

const BackendMemory& CpuMemory() {
  static const CpuMemoryImpl memory;
  return memory;
}

}  // namespace kernels
}  // namespace stallfree
