// The launcher's rank: which process prints in `epx demo` and `epx bench` under torchrun / mpirun.
// A RANK that is not a whole number must be an error naming it: read as 0, every process would print.
#include <gtest/gtest.h>

#include <string>

#include "core/scoped_env.h"
#include "epx/error.h"
#include "tools/launch.h"

namespace epx {
namespace {

using detail::ScopedEnv;

TEST(Launcher, RankIsReadAsAWholeNumber) {
  {
    const ScopedEnv r("RANK", nullptr);
    EXPECT_EQ(tools::launcher_rank(), 0);
  }
  {
    const ScopedEnv r("RANK", "");
    EXPECT_EQ(tools::launcher_rank(), 0);
  }
  {
    const ScopedEnv r("RANK", "3");
    EXPECT_EQ(tools::launcher_rank(), 3);
  }
  {
    const ScopedEnv r("RANK", "0");
    EXPECT_EQ(tools::launcher_rank(), 0);
  }
}

TEST(Launcher, RankThatIsNotAWholeNumberIsAnErrorNamingIt) {
  for (const char* bad : {"abc", "1x", " 2 ", "-1", "99999999999", "1.5"}) {
    const ScopedEnv r("RANK", bad);
    try {
      tools::launcher_rank();
      ADD_FAILURE() << "RANK=\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("RANK"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("\"") + bad + "\""), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace epx
