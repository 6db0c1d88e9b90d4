// Which transport an NCCL group is asked for: GroupConfig::transport when it names one, else
// EPX_TRANSPORT, else auto; bad values are errors naming the variable, the expected values and
// the actual one. Pure host logic, so it runs everywhere (the GPU suites check the groups built).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/device_memory.h"
#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/error.h"

namespace epx {
namespace {

// Sets (or unsets, with nullptr) an environment variable for one scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

GroupConfig config_with(Transport t) {
  GroupConfig c;
  c.num_experts = 8;
  c.hidden = 64;
  c.max_tokens_per_rank = 16;
  c.max_topk = 2;
  c.transport = t;
  return c;
}

std::string error_of(Transport t) {
  try {
    requested_transport(config_with(t), "epx::test");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TransportSelect, ParsesTheDocumentedValues) {
  EXPECT_EQ(parse_transport("auto", "f"), Transport::kAuto);
  EXPECT_EQ(parse_transport("zerocopy", "f"), Transport::kZeroCopy);
  EXPECT_EQ(parse_transport("zero-copy", "f"), Transport::kZeroCopy);
  EXPECT_EQ(parse_transport("staged", "f"), Transport::kStaged);
}

TEST(TransportSelect, BadValueNamesVariableExpectedAndActual) {
  ScopedEnv env("EPX_TRANSPORT", "fast");
  const std::string msg = error_of(Transport::kAuto);
  EXPECT_NE(msg.find("epx::test: EPX_TRANSPORT is \"fast\", expected one of auto, zerocopy, staged"),
            std::string::npos)
      << msg;
  // Also when the config names the transport: a typo in the environment never goes unnoticed.
  EXPECT_NE(error_of(Transport::kStaged).find("EPX_TRANSPORT is \"fast\""), std::string::npos);
  ScopedEnv empty("EPX_TRANSPORT", "");
  EXPECT_NE(error_of(Transport::kAuto).find("EPX_TRANSPORT is \"\", expected one of auto, zerocopy, staged"),
            std::string::npos);
}

TEST(TransportSelect, ConfigWinsThenEnvironmentThenAuto) {
  {
    ScopedEnv env("EPX_TRANSPORT", nullptr);
    EXPECT_EQ(requested_transport(config_with(Transport::kAuto), "f"), Transport::kAuto);
    EXPECT_EQ(requested_transport(config_with(Transport::kStaged), "f"), Transport::kStaged);
    EXPECT_EQ(requested_transport(config_with(Transport::kZeroCopy), "f"), Transport::kZeroCopy);
  }
  {
    ScopedEnv env("EPX_TRANSPORT", "staged");
    EXPECT_EQ(requested_transport(config_with(Transport::kAuto), "f"), Transport::kStaged);
    EXPECT_EQ(requested_transport(config_with(Transport::kZeroCopy), "f"), Transport::kZeroCopy);
  }
  {
    ScopedEnv env("EPX_TRANSPORT", "zerocopy");
    EXPECT_EQ(requested_transport(config_with(Transport::kAuto), "f"), Transport::kZeroCopy);
    EXPECT_EQ(requested_transport(config_with(Transport::kStaged), "f"), Transport::kStaged);
  }
  {
    ScopedEnv env("EPX_TRANSPORT", "auto");
    EXPECT_EQ(requested_transport(config_with(Transport::kAuto), "f"), Transport::kAuto);
  }
}

// Exact staged sizes: the config turns them on; otherwise EPX_STAGED_SIZES (exact / fixed), whose
// other values are errors naming the variable, the expected values and the actual one.
TEST(TransportSelect, StagedExactSizesFromConfigThenEnvironment) {
  GroupConfig on = config_with(Transport::kStaged), off = config_with(Transport::kStaged);
  on.staged_exact_sizes = true;
  {
    ScopedEnv env("EPX_STAGED_SIZES", nullptr);
    EXPECT_TRUE(resolved_staged_exact_sizes(on, "f"));
    EXPECT_FALSE(resolved_staged_exact_sizes(off, "f"));
  }
  {
    ScopedEnv env("EPX_STAGED_SIZES", "exact");
    EXPECT_TRUE(resolved_staged_exact_sizes(off, "f"));
  }
  {
    ScopedEnv env("EPX_STAGED_SIZES", "fixed");
    EXPECT_FALSE(resolved_staged_exact_sizes(off, "f"));
    EXPECT_TRUE(resolved_staged_exact_sizes(on, "f")) << "the config's request stands";
  }
  {
    ScopedEnv env("EPX_STAGED_SIZES", "tight");
    for (const GroupConfig& c : {off, on}) {  // also when the config decides
      try {
        resolved_staged_exact_sizes(c, "epx::test");
        FAIL() << "EPX_STAGED_SIZES=tight accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("epx::test: EPX_STAGED_SIZES is \"tight\", expected exact or fixed"),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(TransportSelect, HostAndLocalAreNotNcclTransports) {
  ScopedEnv env("EPX_TRANSPORT", nullptr);
  EXPECT_NE(error_of(Transport::kHost).find("config.transport is host, expected auto, zero-copy or staged"),
            std::string::npos)
      << error_of(Transport::kHost);
  EXPECT_NE(error_of(Transport::kLocal).find("config.transport is local"), std::string::npos);
}

// The NCCL group constructors read the variable before anything else (no GPU needed to see it).
TEST(TransportSelect, GroupCreationRejectsBadEnvironmentFirst) {
  if (!detail::cuda_backend_built()) GTEST_SKIP() << "built without the CUDA backend: no NCCL groups";
  ScopedEnv env("EPX_TRANSPORT", "nvlink");
  try {
    Group::create_all_local(config_with(Transport::kAuto));
    FAIL() << "create_all_local accepted EPX_TRANSPORT=nvlink";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(
                  "epx::Group::create_all_local: EPX_TRANSPORT is \"nvlink\", expected one of auto, zerocopy, staged"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace epx
