// The list of environment variables epx reads (core/env_names.h): a set EPX_* name outside it is
// reported (a misspelt variable otherwise changes nothing without a word), the list is exactly the
// names the sources read, and README.md documents each of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "core/env_names.h"
#include "core/scoped_env.h"

namespace epx {
namespace {

using detail::ScopedEnv;

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(EnvNames, SetNamesThatEpxDoesNotReadAreReported) {
  const ScopedEnv typo("EPX_TRANSPROT", "staged");
  const ScopedEnv known("EPX_PDL", "1");
  const ScopedEnv other("EPXNOTOURS", "1");
  const std::vector<std::string> unknown = detail::unknown_env_names();
  EXPECT_TRUE(contains(unknown, "EPX_TRANSPROT"));
  EXPECT_FALSE(contains(unknown, "EPX_PDL"));
  EXPECT_FALSE(contains(unknown, "EPXNOTOURS"));
  EXPECT_TRUE(std::is_sorted(unknown.begin(), unknown.end()));
}

TEST(EnvNames, UnsettingTheTypoClearsIt) {
  {
    const ScopedEnv typo("EPX_COMBINE_SUMBLOCKS", "66");
    EXPECT_TRUE(contains(detail::unknown_env_names(), "EPX_COMBINE_SUMBLOCKS"));
  }
  EXPECT_FALSE(contains(detail::unknown_env_names(), "EPX_COMBINE_SUMBLOCKS"));
}

// Every "EPX_..." string literal in the library's and tools' sources: what they pass to getenv and
// to the env_choice family.
std::set<std::string> names_in_sources() {
  const std::filesystem::path root = EPX_SOURCE_DIR;
  const std::regex literal("\"(EPX_[A-Z0-9_]+)\"");
  std::set<std::string> names;
  for (const char* dir : {"src", "tools", "include", "bindings"}) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root / dir)) {
      if (!entry.is_regular_file()) continue;
      const std::string ext = entry.path().extension().string();
      if (ext != ".cpp" && ext != ".cu" && ext != ".h" && ext != ".cuh" && ext != ".py") continue;
      if (entry.path().filename() == "env_names.cpp") continue;  // the list itself
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      for (std::sregex_iterator it(s.begin(), s.end(), literal), end; it != end; ++it) names.insert((*it)[1]);
    }
  }
  return names;
}

TEST(EnvNames, TheListIsWhatTheSourcesReadAndReadmeDocumentsIt) {
  const std::set<std::string> read = names_in_sources();
  const std::vector<std::string>& known = detail::known_env_names();
  ASSERT_GT(read.size(), 20u) << "the scan of " << EPX_SOURCE_DIR << " found too few names";
  for (const std::string& n : read) EXPECT_TRUE(contains(known, n)) << n << " is read but not in known_env_names()";
  for (const std::string& n : known) EXPECT_TRUE(read.count(n)) << n << " is listed but nothing reads it";
  std::ifstream readme(std::filesystem::path(EPX_SOURCE_DIR) / "README.md");
  std::stringstream text;
  text << readme.rdbuf();
  const std::string doc = text.str();
  ASSERT_FALSE(doc.empty());
  for (const std::string& n : known) EXPECT_NE(doc.find(n), std::string::npos) << n << " is not in README.md";
}

}  // namespace
}  // namespace epx
