// What the ranks of a group must agree on at creation (comm/group_votes.h): the summed votes of a
// group pass only when every rank chose the same transport and, on zero-copy, the same opening
// barrier placement and count-header scheme; otherwise the error names the setting and the split.
// Pure host logic; the multi-process GPU check starts two ranks with different settings.
#include <gtest/gtest.h>

#include <string>

#include "comm/group_votes.h"

namespace epx::comm {
namespace {

GroupVotes zero_copy(int R, int barrier_launch, int one_header) {
  GroupVotes v;
  v.n[GroupVotes::kZeroCopy] = R;
  v.n[GroupVotes::kBarrierLaunch] = barrier_launch;
  v.n[GroupVotes::kOneHeaderCopy] = one_header;
  return v;
}

std::string error_of(const GroupVotes& v, int R) {
  try {
    check_group_votes(v, R, "epx::Group::create");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GroupVotes, AgreeingRanksPass) {
  for (int R : {1, 2, 8}) {
    EXPECT_EQ(error_of(zero_copy(R, 0, 0), R), "");
    EXPECT_EQ(error_of(zero_copy(R, R, 0), R), "");
    EXPECT_EQ(error_of(zero_copy(R, 0, R), R), "");
    EXPECT_EQ(error_of(zero_copy(R, R, R), R), "");
    GroupVotes staged;
    staged.n[GroupVotes::kStaged] = R;
    staged.n[GroupVotes::kExactSizes] = R;
    EXPECT_EQ(error_of(staged, R), "");
  }
}

TEST(GroupVotes, MixedOpeningBarriersNameTheVariableAndTheSplit) {
  const std::string e = error_of(zero_copy(4, 1, 0), 4);
  EXPECT_NE(e.find("epx::Group::create"), std::string::npos) << e;
  EXPECT_NE(e.find("EPX_EP_BARRIER"), std::string::npos) << e;
  EXPECT_NE(e.find("1 of the group's 4 ranks"), std::string::npos) << e;
  EXPECT_NE(e.find("and 3 inside"), std::string::npos) << e;
}

TEST(GroupVotes, MixedHeaderCopiesNameTheVariableAndTheSplit) {
  const std::string e = error_of(zero_copy(2, 0, 1), 2);
  EXPECT_NE(e.find("EPX_PREPARE_HEADERS"), std::string::npos) << e;
  EXPECT_NE(e.find("1 of the group's 2 ranks"), std::string::npos) << e;
}

TEST(GroupVotes, ZeroCopySettingsDoNotMatterOnTheStagedTransport) {
  // The staged transport holds its barriers in launches and one header copy whatever the settings say.
  GroupVotes v;
  v.n[GroupVotes::kStaged] = 2;
  v.n[GroupVotes::kBarrierLaunch] = 1;
  v.n[GroupVotes::kOneHeaderCopy] = 1;
  EXPECT_EQ(error_of(v, 2), "");
}

TEST(GroupVotes, TransportsAndExactSizesMustAgree) {
  GroupVotes mixed;
  mixed.n[GroupVotes::kZeroCopy] = 1;
  mixed.n[GroupVotes::kStaged] = 1;
  EXPECT_NE(error_of(mixed, 2).find("disagree on the transport"), std::string::npos);
  GroupVotes exact;
  exact.n[GroupVotes::kStaged] = 3;
  exact.n[GroupVotes::kExactSizes] = 2;
  EXPECT_NE(error_of(exact, 3).find("EPX_STAGED_SIZES"), std::string::npos);
  GroupVotes failed = zero_copy(2, 0, 0);
  failed.n[GroupVotes::kFailed] = 1;
  EXPECT_NE(error_of(failed, 2).find("cannot use the transport"), std::string::npos);
}

}  // namespace
}  // namespace epx::comm
