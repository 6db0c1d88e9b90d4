// Minimal "--key value" / "--flag" parsing for the sub-commands: unknown options are errors that
// list the accepted ones.
#pragma once

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "epx/error.h"

namespace epx::tools {

/// The non-empty items of a comma-separated option value ("a,,b" -> {"a", "b"}).
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

class Args {
 public:
  Args(const char* command, const std::vector<std::string>& args, std::set<std::string> known_values,
       std::set<std::string> known_flags = {})
      : command_(command) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      const std::string key = a.rfind("--", 0) == 0 ? a.substr(2) : "";
      if (known_flags.count(key)) {
        flags_.insert(key);
      } else if (known_values.count(key)) {
        require(i + 1 < args.size(), command_, "option --", key, " needs a value");
        values_[key] = args[++i];
      } else {
        std::string accepted;
        for (const auto& k : known_values) accepted += " --" + k + " <value>";
        for (const auto& k : known_flags) accepted += " --" + k;
        throw Error(Status::kInvalidArgument, std::string(command_) + ": unknown option '" + a + "'; accepted:" + accepted);
      }
    }
  }
  bool flag(const std::string& k) const { return flags_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def) const {
    auto it = values_.find(k);
    return it == values_.end() ? def : it->second;
  }
  long long integer(const std::string& k, long long def) const {
    auto it = values_.find(k);
    if (it == values_.end()) return def;
    try {
      size_t used = 0;
      long long v = std::stoll(it->second, &used);
      if (used == it->second.size()) return v;
    } catch (...) {
    }
    throw Error(Status::kInvalidArgument, std::string(command_) + ": --" + k + " is '" + it->second + "', expected an integer");
  }

 private:
  const char* command_;
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

}  // namespace epx::tools
