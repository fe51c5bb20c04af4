#include "common/flags.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace stallfree {

FlagSet::FlagSet(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void FlagSet::Add(const std::string& name, Kind kind, void* value, const std::string& help,
                  std::string default_text) {
  flags_.push_back(Flag{name, kind, value, help, std::move(default_text)});
}
void FlagSet::AddString(const std::string& name, std::string* value, const std::string& help) {
  Add(name, Kind::kString, value, help, "\"" + *value + "\"");
}
void FlagSet::AddInt(const std::string& name, int64_t* value, const std::string& help) {
  Add(name, Kind::kInt, value, help, absl::StrCat(*value));
}
void FlagSet::AddDouble(const std::string& name, double* value, const std::string& help) {
  Add(name, Kind::kDouble, value, help, absl::StrCat(*value));
}
void FlagSet::AddBool(const std::string& name, bool* value, const std::string& help) {
  Add(name, Kind::kBool, value, help, *value ? "true" : "false");
}

absl::Status FlagSet::Set(const Flag& flag, const std::string& text, const std::string& source) {
  bool ok = true;
  switch (flag.kind) {
    case Kind::kString:
      *static_cast<std::string*>(flag.value) = text;
      break;
    case Kind::kInt: {
      int64_t v;
      ok = absl::SimpleAtoi(text, &v);
      if (ok) *static_cast<int64_t*>(flag.value) = v;
      break;
    }
    case Kind::kDouble: {
      double v;
      ok = absl::SimpleAtod(text, &v);
      if (ok) *static_cast<double*>(flag.value) = v;
      break;
    }
    case Kind::kBool: {
      bool v;
      ok = absl::SimpleAtob(text, &v);
      if (ok) *static_cast<bool*>(flag.value) = v;
      break;
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": '", text, "' is not a valid value for --", flag.name));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> FlagSet::Parse(int argc, char** argv) {
  for (const Flag& f : flags_) {
    std::string env = "STALLFREE_";
    for (char c : f.name) env.push_back(c == '-' ? '_' : static_cast<char>(toupper(c)));
    if (const char* v = getenv(env.c_str())) RETURN_IF_ERROR(Set(f, v, env));
  }
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return true;
    // Single-dash long flags (-o json) are accepted as --o json.
    if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-' && !isdigit(arg[1])) arg = "-" + arg;
    if (arg.size() < 3 || arg[0] != '-' || arg[1] != '-') {
      positional_.push_back(arg);
      continue;
    }
    std::string body = arg.substr(2);
    std::string value;
    bool has_value = false;
    size_t eq = body.find('=');
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
      body = body.substr(0, eq);
      has_value = true;
    }
    for (char& c : body) if (c == '-') c = '_';
    const Flag* found = nullptr;
    bool negated = false;
    for (const Flag& f : flags_) {
      if (f.name == body) found = &f;
      if (f.kind == Kind::kBool && "no" + f.name == body) {
        found = &f;
        negated = true;
      }
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", body, "; see ", program_, " --help"));
    }
    if (found->kind == Kind::kBool && !has_value) {
      *static_cast<bool*>(found->value) = !negated;
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", body, " needs a value"));
      }
      value = argv[++i];
    }
    RETURN_IF_ERROR(Set(*found, value, "--" + body));
  }
  return false;
}

int FlagSet::ParseCommandLine(int argc, char** argv) {
  absl::StatusOr<bool> help = Parse(argc, argv);
  if (!help.ok()) {
    fprintf(stderr, "%s: %s\n", program_.c_str(), std::string(help.status().message()).c_str());
    return 2;
  }
  if (*help) {
    printf("%s", Help().c_str());
    return 0;
  }
  return -1;
}

std::string FlagSet::Help() const {
  std::string out = absl::StrCat(program_, ": ", summary_, "\n\nFlags (each also read from "
                                 "STALLFREE_<NAME> in the environment):\n");
  for (const Flag& f : flags_) {
    absl::StrAppendFormat(&out, "  --%-22s %s (default: %s)\n", f.name, f.help, f.default_text);
  }
  return out;
}

}  // namespace stallfree
