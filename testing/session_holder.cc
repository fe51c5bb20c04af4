// Test helper: opens a session on the daemon at argv[1], registers argv[2] fp32 elements,
// prints "ready <session_id>" and sleeps until killed.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "client/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: session_holder SOCKET ELEMENTS\n");
    return 2;
  }
  auto client = stallfree::Client::Connect(argv[1]);
  if (!client.ok()) return 1;
  auto session = (*client)->OpenSession("holder", 7);
  if (!session.ok()) return 1;
  absl::Status st = (*session)->RegisterParams({{"w", {atoll(argv[2])}, stallfree::v1::DTYPE_FP32}});
  if (!st.ok()) {
    fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  printf("ready %lu\n", (unsigned long)(*session)->ref().session_id());
  fflush(stdout);
  for (;;) pause();
}
