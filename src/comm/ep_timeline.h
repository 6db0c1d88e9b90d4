// In-kernel timestamps of the overlapped zero-copy dispatch and combine: where a decode-size op
// spends its microseconds (the launch, the barrier, the first arrival, the last one), per block.
// Recorded only in builds configured with -DEPX_EP_TIMELINE=ON (a store per phase per block on
// thread 0); otherwise nothing is recorded and the reads return false. Host-only declarations.
#pragma once

#include <cstdint>
#include <vector>

namespace epx::comm {

/// Phases stamped per block (%globaltimer, ns): launch entry, the opening barrier signalled, the
/// first item begun (a sender past its first peer wait, a reader past its first arrival wait), the
/// block's role done (warp 0), the block done (after the last-block ticket).
enum EpTimelinePhase { kTlEntry, kTlBarrier, kTlFirst, kTlRoleDone, kTlExit, kTlPhases };

/// One launch's stamps on the current device: blocks x kTlPhases, a zero where a phase did not
/// occur (a block with no item); the first `writer_blocks` blocks are the writers (senders /
/// partial reducers), the rest the readers (expanders / sums).
struct EpTimeline {
  int blocks = 0;
  int writer_blocks = 0;
  std::vector<uint64_t> stamps;
};

bool ep_timeline_enabled();
/// Forgets the stamps of the current device's last overlapped dispatch / combine launch.
void ep_timeline_clear_dispatch();
void ep_timeline_clear_combine();
/// The stamps of the current device's last overlapped dispatch / combine since the clear (false if
/// none, or a build without the timeline).
bool ep_timeline_read_dispatch(EpTimeline& out);
bool ep_timeline_read_combine(EpTimeline& out);

}  // namespace epx::comm
