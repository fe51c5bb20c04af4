// common/atomic_file.h: a write round-trips, replaces an existing file by a rename (a reader of
// the old file keeps the old bytes, no temporary file stays), MakeDirs creates missing parents,
// and failures name the path with a code that says what went wrong.
#include "common/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace stallfree {
namespace {

// A fresh directory under /tmp (world-traversable, for the unprivileged child below).
class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char templ[] = "/tmp/atomic_file_test.XXXXXX";
    ASSERT_NE(mkdtemp(templ), nullptr);
    dir_ = templ;
    chmod(dir_.c_str(), 0755);
  }
  void TearDown() override {
    const std::string cmd = "chmod -R u+w '" + dir_ + "' && rm -rf '" + dir_ + "'";
    EXPECT_EQ(system(cmd.c_str()), 0);
  }
  std::vector<std::string> Entries(const std::string& dir) {
    std::vector<std::string> names;
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return names;
    while (struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
    return names;
  }

  std::string dir_;
};

std::string Read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST_F(AtomicFileTest, RoundTripsAndLeavesNoTemporaryFile) {
  const std::string path = dir_ + "/a.bin";
  std::string content = "head";
  content.push_back('\0');
  content += std::string(1 << 20, 'x');
  ASSERT_TRUE(WriteFileAtomically(path, content).ok());
  EXPECT_EQ(Read(path), content);
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{"a.bin"});
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644 & ~umask(umask(0)));
}

TEST_F(AtomicFileTest, ReplacesAnExistingFileByARename) {
  const std::string path = dir_ + "/state";
  ASSERT_TRUE(WriteFileAtomically(path, "old content").ok());
  // A reader that opened the old file keeps reading it whole: the new content is a new inode,
  // never a rewrite of the old one in place.
  const int old_fd = open(path.c_str(), O_RDONLY);
  ASSERT_GE(old_fd, 0);
  ASSERT_TRUE(WriteFileAtomically(path, "new").ok());
  char buf[32] = {};
  EXPECT_EQ(pread(old_fd, buf, sizeof buf, 0), 11);
  EXPECT_EQ(std::string(buf), "old content");
  close(old_fd);
  EXPECT_EQ(Read(path), "new");
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{"state"});
}

TEST_F(AtomicFileTest, AStreamedWriteIsInvisibleUntilCommitAndDiscardedWithout) {
  const std::string path = dir_ + "/big";
  ASSERT_TRUE(WriteFileAtomically(path, "before").ok());
  {
    absl::StatusOr<std::unique_ptr<AtomicFileWriter>> w = AtomicFileWriter::Open(path, 0600);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append("abandoned", 9).ok());
    EXPECT_EQ(Read(path), "before");
    EXPECT_EQ((*w)->temp_path().rfind(dir_ + "/.big.tmp.", 0), 0u) << (*w)->temp_path();
  }  // no Commit: the temporary file goes, the file stays
  EXPECT_EQ(Read(path), "before");
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{"big"});
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> w = AtomicFileWriter::Open(path, 0600);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append("one ", 4).ok());
  ASSERT_TRUE((*w)->Append("two", 3).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(Read(path), "one two");
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{"big"});
}

TEST_F(AtomicFileTest, MakeDirsCreatesMissingParents) {
  const std::string nested = dir_ + "/a/b/c";
  ASSERT_TRUE(MakeDirs(nested).ok());
  ASSERT_TRUE(MakeDirs(nested).ok()) << "an existing directory is fine";
  ASSERT_TRUE(WriteFileAtomically(nested + "/f", "x").ok());
  EXPECT_EQ(Read(nested + "/f"), "x");
  ASSERT_TRUE(MakeDirs(dir_ + "/private/d", 0700).ok());
  struct stat st;
  ASSERT_EQ(stat((dir_ + "/private").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700);
  // A file where a directory should be.
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/file", "x").ok());
  absl::Status st_file = MakeDirs(dir_ + "/file");
  EXPECT_EQ(st_file.code(), absl::StatusCode::kFailedPrecondition) << st_file;
  EXPECT_NE(st_file.message().find(dir_ + "/file"), std::string::npos) << st_file;
  absl::Status st_below = MakeDirs(dir_ + "/file/sub");
  EXPECT_EQ(st_below.code(), absl::StatusCode::kFailedPrecondition) << st_below;
  EXPECT_NE(st_below.message().find(dir_ + "/file/sub"), std::string::npos) << st_below;
}

TEST_F(AtomicFileTest, AMissingDirectoryIsNotFoundNamingThePath) {
  const std::string path = dir_ + "/missing/f";
  absl::Status st = WriteFileAtomically(path, "x");
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find(dir_ + "/missing/"), std::string::npos) << st;
  EXPECT_NE(st.message().find("errno"), std::string::npos) << st;
}

// Root writes anywhere, so the check runs in a child that drops to an unprivileged uid when
// the test runs as root. The child exits 0 if the write failed as expected, else 1 + the step.
TEST_F(AtomicFileTest, AnUnwritableDirectoryIsPermissionDeniedNamingThePath) {
  const std::string ro = dir_ + "/read-only";
  ASSERT_TRUE(MakeDirs(ro, 0555).ok());
  ASSERT_EQ(chmod(ro.c_str(), 0555), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(2);
    const absl::Status st = WriteFileAtomically(ro + "/f", "x");
    if (st.code() != absl::StatusCode::kPermissionDenied) _exit(3);
    if (st.message().find(ro + "/.f.tmp.") == std::string::npos) _exit(4);
    const absl::Status made = MakeDirs(ro + "/sub");
    if (made.code() != absl::StatusCode::kPermissionDenied) _exit(5);
    if (made.message().find(ro + "/sub") == std::string::npos) _exit(6);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1 + the failed step (2: cannot drop root)";
  EXPECT_EQ(Entries(ro), std::vector<std::string>{});
}

TEST_F(AtomicFileTest, RenameDurablyMovesAFileAndNamesBothPathsOnFailure) {
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/upload", "bytes").ok());
  ASSERT_TRUE(RenameDurably(dir_ + "/upload", dir_ + "/final").ok());
  EXPECT_EQ(Read(dir_ + "/final"), "bytes");
  absl::Status st = RenameDurably(dir_ + "/upload", dir_ + "/final");
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find(dir_ + "/upload -> " + dir_ + "/final"), std::string::npos) << st;
}

}  // namespace
}  // namespace stallfree
