// The kernel-choice environment variables: a listed value picks its index, unset or empty picks the
// caller's default, and anything else is an error naming the variable, the value and every choice.
#include <gtest/gtest.h>

#include <climits>
#include <string>
#include <utility>

#include "core/env_choice.h"
#include "core/scoped_env.h"
#include "epx/error.h"

namespace epx {
namespace {

using detail::ScopedEnv;

TEST(EnvChoice, ListedValuesPickTheirIndexAndUnsetOrEmptyPicksNone) {
  {
    const ScopedEnv v("EPX_TEST_CHOICE", nullptr);
    EXPECT_EQ(detail::env_choice("EPX_TEST_CHOICE", {"stride", "claim"}), -1);
  }
  {
    const ScopedEnv v("EPX_TEST_CHOICE", "");
    EXPECT_EQ(detail::env_choice("EPX_TEST_CHOICE", {"stride", "claim"}), -1);
  }
  const char* values[] = {"auto", "lean", "wide"};
  for (int i = 0; i < 3; ++i) {
    const ScopedEnv v("EPX_TEST_CHOICE", values[i]);
    EXPECT_EQ(detail::env_choice("EPX_TEST_CHOICE", {"auto", "lean", "wide"}), i) << values[i];
  }
}

TEST(EnvChoice, AnyOtherValueNamesTheVariableTheValueAndTheChoices) {
  for (const char* bad : {"Claim", "claim ", "4", "phase"}) {
    const ScopedEnv v("EPX_TEST_CHOICE", bad);
    try {
      detail::env_choice("EPX_TEST_CHOICE", {"stride", "claim", "phased"});
      ADD_FAILURE() << "\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      const std::string w = e.what();
      EXPECT_NE(w.find("EPX_TEST_CHOICE"), std::string::npos) << w;
      EXPECT_NE(w.find(std::string("\"") + bad + "\""), std::string::npos) << w;
      EXPECT_NE(w.find("expected stride, claim or phased"), std::string::npos) << w;
    }
  }
}

TEST(EnvChoice, PositiveIntegersOrTheFallback) {
  {
    const ScopedEnv v("EPX_TEST_KNOB", nullptr);
    EXPECT_EQ(detail::env_positive_int("EPX_TEST_KNOB", 66), 66);
  }
  {
    const ScopedEnv v("EPX_TEST_KNOB", "264");
    EXPECT_EQ(detail::env_positive_int("EPX_TEST_KNOB", 66), 264);
  }
  for (const char* bad : {"0", "-3", "2x", "x", "1.5", "99999999999"}) {
    const ScopedEnv v("EPX_TEST_KNOB", bad);
    try {
      detail::env_positive_int("EPX_TEST_KNOB", 66);
      ADD_FAILURE() << "\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("EPX_TEST_KNOB"), std::string::npos) << w;
      EXPECT_NE(w.find("expected a positive integer"), std::string::npos) << w;
    }
  }
}

TEST(EnvChoice, WholeNumbersInIntRange) {
  for (const auto& [text, value] : {std::pair<const char*, int>{"0", 0}, {"-3", -3}, {"+7", 7}, {"2147483647", INT_MAX}}) {
    int out = 99;
    EXPECT_TRUE(detail::parse_int(text, out)) << text;
    EXPECT_EQ(out, value) << text;
  }
  for (const char* bad : {"", "x", "1x", "1.5", " 3 ", "2147483648", "-99999999999"}) {
    int out = 99;
    EXPECT_FALSE(detail::parse_int(bad, out)) << "\"" << bad << "\"";
    EXPECT_EQ(out, 99) << "\"" << bad << "\" changed the output";
  }
}

TEST(EnvChoice, PositiveNumbersUpToTheBoundOrTheFallback) {
  {
    const ScopedEnv v("EPX_TEST_KNOB", "");
    EXPECT_EQ(detail::env_positive_number("EPX_TEST_KNOB", 10.0, 100.0), 10.0);
  }
  for (const auto& [text, value] : {std::pair<const char*, double>{"2.5", 2.5}, {"1e-3", 1e-3}, {"100", 100.0}}) {
    const ScopedEnv v("EPX_TEST_KNOB", text);
    EXPECT_EQ(detail::env_positive_number("EPX_TEST_KNOB", 10.0, 100.0), value) << text;
  }
  for (const char* bad : {"0", "-1", "100.5", "3 ", "x", "inf", "nan", "1e999"}) {
    const ScopedEnv v("EPX_TEST_KNOB", bad);
    try {
      detail::env_positive_number("EPX_TEST_KNOB", 10.0, 100.0);
      ADD_FAILURE() << "\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("EPX_TEST_KNOB"), std::string::npos) << w;
      EXPECT_NE(w.find("expected a positive number up to 100"), std::string::npos) << w;
    }
  }
}

}  // namespace
}  // namespace epx
