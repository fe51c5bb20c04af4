#include "client/host_register.h"

namespace stallfree {
bool HostRegister(void*, uint64_t, std::string* error) {
  error->clear();
  return false;
}
void HostUnregister(void*, uint64_t) {}
}  // namespace stallfree
