// Loads the raw little-endian float32 reference tensors under tests/testdata/.
#pragma once

#include <fstream>
#include <string>
#include <vector>

namespace stallfree {
namespace testing {

inline std::vector<float> LoadF32(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return {};
  std::streamsize n = f.tellg();
  f.seekg(0);
  std::vector<float> out(static_cast<size_t>(n) / sizeof(float));
  f.read(reinterpret_cast<char*>(out.data()), n);
  return out;
}

}  // namespace testing
}  // namespace stallfree
