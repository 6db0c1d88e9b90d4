// What every rank of a group must agree on at creation, as counts summed over the group (one small
// all-reduce when the group spans processes). A mix would not fail at once: ranks on different
// transports, staged exchange sizes, barrier placements or count-header schemes wait for each other
// at the first op until its timeout. So creation checks the counts and every rank throws with the
// same message, naming the setting and how many ranks chose each way.
#pragma once

#include <array>
#include <cstdint>

#include "epx/error.h"

namespace epx::comm {

struct GroupVotes {
  enum Index {
    kFailed,          // ranks that cannot serve the transport they were asked for
    kZeroCopy,        // ranks that chose zero-copy
    kStaged,          // ranks that chose staged
    kExactSizes,      // ranks that asked for exact staged sizes
    kBarrierLaunch,   // zero-copy: ranks whose op opening barrier is a launch of its own (EPX_EP_BARRIER=launch)
    kOneHeaderCopy,   // zero-copy: ranks whose prepare writes one count-header copy (EPX_PREPARE_HEADERS=one)
    kCount
  };
  std::array<int32_t, kCount> n{};
};

/// Throws (naming `fn`) unless the summed votes of a group of R ranks agree: no failed rank, one
/// transport, and on that transport every rank the same way on each of its settings.
inline void check_group_votes(const GroupVotes& v, int R, const char* fn) {
  const auto& n = v.n;
  require_status(n[GroupVotes::kFailed] == 0, Status::kNotSupported, fn, n[GroupVotes::kFailed], " of the group's ", R,
                 " ranks cannot use the transport they were asked for (see their errors)");
  require(n[GroupVotes::kZeroCopy] == 0 || n[GroupVotes::kStaged] == 0, fn, "the ranks disagree on the transport: ",
          n[GroupVotes::kZeroCopy], " chose zero-copy and ", n[GroupVotes::kStaged],
          " chose staged (GroupConfig::transport and EPX_TRANSPORT must agree on every rank)");
  // Exact sizes change how many bytes each exchange moves: a mix would leave sends and receives of
  // different sizes.
  const int32_t exact = n[GroupVotes::kExactSizes];
  require(n[GroupVotes::kStaged] == 0 || exact == 0 || exact == R, fn, exact, " of the group's ", R,
          " ranks asked for exact staged sizes and the others did not (GroupConfig::staged_exact_sizes and "
          "EPX_STAGED_SIZES must agree on every rank)");
  if (n[GroupVotes::kZeroCopy] == 0) return;
  // The ranks count their barriers alike and read the header copy their peers wrote: a rank that
  // holds its barrier elsewhere, or reads another copy, waits for a signal that never comes.
  const int32_t launch = n[GroupVotes::kBarrierLaunch];
  require(launch == 0 || launch == R, fn, launch, " of the group's ", R,
          " ranks hold each zero-copy op's opening barrier in a launch of its own (EPX_EP_BARRIER=launch) and ",
          R - launch, " inside the op's launch (EPX_EP_BARRIER=inline, the default); set it alike on every rank");
  const int32_t one = n[GroupVotes::kOneHeaderCopy];
  require(one == 0 || one == R, fn, one, " of the group's ", R,
          " ranks write one copy of prepare's count headers (EPX_PREPARE_HEADERS=one) and ", R - one,
          " alternate between two (EPX_PREPARE_HEADERS=two, the default); set it alike on every rank");
}

}  // namespace epx::comm
