// Splitting one row's work over several warps, for the overlapped zero-copy combine at decode
// sizes. With few rows, one warp per row leaves most of the GPU idle and runs one long chain of
// dependent loads; the combine then gives each row to up to kMaxPieces warps, each taking a
// contiguous range of the row's vectors (multiples of 32, one per lane). The per-element arithmetic
// does not depend on the split, so results do not either.
//
// A slot counts kArrivalUnit on its chunk's arrival counter once complete: each of its `pieces`
// writers adds kArrivalUnit / pieces after its own stores (a release), so the receiver waits for
// n x kArrivalUnit without knowing how the writer split the rows, and no writer waits for another.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace epx::comm {

constexpr int kMaxPieces = 8;
constexpr uint32_t kArrivalUnit = 840;  // the least common multiple of 1..8
static_assert(kArrivalUnit % 5 == 0 && kArrivalUnit % 6 == 0 && kArrivalUnit % 7 == 0 && kArrivalUnit % 8 == 0,
              "every piece count must divide the arrival unit");

/// The most pieces a row of `nvec` vectors takes: none under 32 vectors (one per lane), at most
/// kMaxPieces.
EPX_HOST_DEVICE inline int max_pieces_of(int64_t nvec) {
  const int64_t p = nvec / 32;
  return p < 1 ? 1 : p > kMaxPieces ? kMaxPieces : static_cast<int>(p);
}

/// Vectors [begin, end) of a row.
struct VecRange {
  int64_t begin, end;
};

/// Warps per row so that `rows` rows keep `warps` warps busy: 1..min(cap, kMaxPieces), and no
/// piece under 32 vectors (one per lane) of the row's `nvec`.
EPX_HOST_DEVICE inline int pieces_for(int64_t rows, int64_t warps, int64_t nvec, int cap) {
  if (rows <= 0) return 1;
  int64_t p = warps / rows;
  if (p > nvec / 32) p = nvec / 32;
  if (p > cap) p = cap;
  if (p > kMaxPieces) p = kMaxPieces;
  return p < 1 ? 1 : static_cast<int>(p);
}

/// Piece `piece` of `pieces` of a row of `nvec` vectors: equal ranges rounded up to 32 vectors, so
/// the last ones may be short or empty (an empty piece still counts its share of the arrival).
EPX_HOST_DEVICE inline VecRange piece_range(int64_t nvec, int pieces, int piece) {
  const int64_t per = ((nvec + pieces - 1) / pieces + 31) / 32 * 32;
  const int64_t begin = piece * per < nvec ? piece * per : nvec;
  return VecRange{begin, begin + per < nvec ? begin + per : nvec};
}

/// A queue of `items` rows split into pieces: the first `head` rows in `pieces` pieces each, the rest
/// (the queue's tail) in `tail_pieces`. The overlapped combine hands its partials out in this order;
/// finer pieces at the end shorten the wait for the last warps' rows without paying the extra
/// per-piece release on every row.
struct PieceQueue {
  int items = 0, head = 0, pieces = 1, tail_pieces = 1;

  /// Entries in the queue: one per (row, piece).
  EPX_HOST_DEVICE int length() const { return head * pieces + (items - head) * tail_pieces; }

  /// Entry q (0 <= q < length()): its row, its piece and how many pieces that row has.
  EPX_HOST_DEVICE void at(int q, int& item, int& piece, int& of) const {
    const int head_entries = head * pieces;
    if (q < head_entries) {
      item = q / pieces;
      piece = q % pieces;
      of = pieces;
    } else {
      const int r = q - head_entries;
      item = head + r / tail_pieces;
      piece = r % tail_pieces;
      of = tail_pieces;
    }
  }
};

}  // namespace epx::comm
