// Command-line flags, in one place per binary. Each flag --name also reads the environment
// variable STALLFREE_<NAME> (upper case, '-' -> '_') as its default, so deployments can set
// knobs without editing unit files. Accepts --name=value, --name value, and --flag / --noflag
// for booleans. --help / -h prints Help().
//
//   FlagSet flags("stallfreed", "The stallfree offload daemon.");
//   std::string socket = "/run/stallfree/stallfreed.sock";
//   flags.AddString("socket", &socket, "gRPC unix socket path");
//   ASSIGN_OR_RETURN(bool help, flags.Parse(argc, argv));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stallfree {

class FlagSet {
 public:
  FlagSet(std::string program, std::string summary);

  void AddString(const std::string& name, std::string* value, const std::string& help);
  void AddInt(const std::string& name, int64_t* value, const std::string& help);
  void AddDouble(const std::string& name, double* value, const std::string& help);
  void AddBool(const std::string& name, bool* value, const std::string& help);

  // Parses argv[1..]. Returns true if help was requested (the caller prints Help() and exits 0).
  // Arguments that are not flags are collected in positional().
  absl::StatusOr<bool> Parse(int argc, char** argv);
  // The usual main() prologue: parses, prints Help() on --help or the error on bad flags.
  // Returns -1 to go on, or the exit code main should return (0 after help, 2 on an error).
  int ParseCommandLine(int argc, char** argv);
  const std::vector<std::string>& positional() const { return positional_; }
  std::string Help() const;

 private:
  enum class Kind { kString, kInt, kDouble, kBool };
  struct Flag {
    std::string name;
    Kind kind;
    void* value;
    std::string help;
    std::string default_text;
  };
  absl::Status Set(const Flag& flag, const std::string& text, const std::string& source);
  void Add(const std::string& name, Kind kind, void* value, const std::string& help,
           std::string default_text);

  std::string program_;
  std::string summary_;
  std::vector<Flag> flags_;
  std::vector<std::string> positional_;
};

}  // namespace stallfree
