// testing::Daemon and a sanitizer's report in its daemon's log: SanitizerReport() finds each
// sanitizer's form (from its report line on), and the Daemon ends the test process on one when
// it goes, so that a test that kills and restarts its daemon cannot take a daemon the sanitizer
// stopped for one it killed.
#include "testing/daemon_process.h"

#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace stallfree {
namespace {

void AppendToLog(const testing::Daemon& d, const std::string& text) {
  std::ofstream(d.dir() + "/daemon.log", std::ios::app) << text;
}

void ClearLog(const testing::Daemon& d) { std::ofstream(d.dir() + "/daemon.log", std::ios::trunc); }

TEST(TestingDaemon, FindsEachSanitizersReportInItsLog) {
  const std::string reports[] = {
      "==42==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x602000003075",
      "==42==ERROR: LeakSanitizer: detected memory leaks",
      "WARNING: ThreadSanitizer: data race (pid=42)",
      "server/requests.cc:36:10: runtime error: signed integer overflow",
  };
  testing::Daemon d({"--threads", "1"}, "info");
  ASSERT_TRUE(d.started()) << d.error();
  EXPECT_EQ(d.SanitizerReport(), "") << "a daemon's own log holds no report";
  for (const std::string& report : reports) {
    AppendToLog(d, "a line of the daemon's log\n" + report + "\n    #0 0x1 in Frame\n");
    const std::string found = d.SanitizerReport();
    EXPECT_EQ(found.rfind(report, 0), 0u) << "from the report's line on:\n" << found;
    EXPECT_NE(found.find("#0 0x1 in Frame"), std::string::npos) << found;
    ClearLog(d);
  }
  AppendToLog(d, "I1205 session 3: an update ran out of time (no report)\n");
  EXPECT_EQ(d.SanitizerReport(), "");
}

TEST(TestingDaemonDeathTest, EndsTheTestOnAReportWhenItGoes) {
  EXPECT_DEATH(
      {
        testing::Daemon d({"--threads", "1"}, "info");
        AppendToLog(d, "==7==ERROR: AddressSanitizer: stack-use-after-return\n");
        d.Kill();
        d.Restart();  // a test's restart appends to the same log
      },
      "stopped on a sanitizer's report:\n==7==ERROR: AddressSanitizer: stack-use-after-return");
}

}  // namespace
}  // namespace stallfree
