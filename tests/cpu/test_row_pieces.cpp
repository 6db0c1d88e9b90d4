// How the zero-copy combine splits a row over warps at decode sizes (comm/row_pieces.h): the
// pieces of a row cover its vectors exactly once, in order, each starting on a multiple of 32, and
// every piece count divides the arrival unit, so the shares of a slot add up to one unit. Pure
// index arithmetic, so it runs everywhere; the GPU suites check the combine's results.
#include <gtest/gtest.h>

#include <vector>

#include "comm/row_pieces.h"

namespace epx::comm {
namespace {

TEST(RowPieces, PiecesOfARowCoverItOnceInOrder) {
  for (int64_t nvec = 0; nvec <= 2100; ++nvec)
    for (int pieces = 1; pieces <= kMaxPieces; ++pieces) {
      int64_t next = 0;
      for (int piece = 0; piece < pieces; ++piece) {
        const VecRange r = piece_range(nvec, pieces, piece);
        ASSERT_EQ(r.begin, next) << "nvec " << nvec << " pieces " << pieces << " piece " << piece;
        ASSERT_LE(r.begin, r.end) << "nvec " << nvec << " pieces " << pieces << " piece " << piece;
        if (r.begin < nvec) {
          ASSERT_EQ(r.begin % 32, 0) << "nvec " << nvec << " pieces " << pieces << " piece " << piece;
        }
        next = r.end;
      }
      ASSERT_EQ(next, nvec) << "nvec " << nvec << " pieces " << pieces;
      EXPECT_EQ(piece_range(nvec, pieces, 0).begin, 0);  // the piece that writes a slot's meta
    }
}

TEST(RowPieces, ModelRowsSplitIntoEightPiecesOfWholeWarps) {
  // H = 7168: bf16 rows are 896 16-byte vectors, 8 pieces of 112 rounded to 128: 7 full, 1 short.
  EXPECT_EQ(piece_range(896, 8, 0).end, 128);
  EXPECT_EQ(piece_range(896, 8, 6).end, 896);
  EXPECT_EQ(piece_range(896, 8, 7).begin, 896);
  EXPECT_EQ(piece_range(896, 8, 7).end, 896);  // empty, yet it adds its share of the arrival
}

TEST(RowPieces, PieceCountFollowsTheIdleWarps) {
  EXPECT_EQ(pieces_for(256, 3168, 896, kMaxPieces), 8);   // T=128 on 2 ranks: ~256 partials
  EXPECT_EQ(pieces_for(8160, 3168, 896, kMaxPieces), 1);  // T=4096: more rows than warps
  EXPECT_EQ(pieces_for(256, 3168, 896, 2), 2);            // EPX_COMBINE_PIECES caps it
  EXPECT_EQ(pieces_for(100, 250, 896, kMaxPieces), 2);    // whole warps only
  EXPECT_EQ(pieces_for(1, 3168, 12, kMaxPieces), 1);      // a row of 12 vectors: no piece under 32
  EXPECT_EQ(pieces_for(1, 3168, 64, kMaxPieces), 2);
  EXPECT_EQ(pieces_for(0, 3168, 896, kMaxPieces), 1);     // nothing to do
  EXPECT_EQ(pieces_for(5, 0, 896, kMaxPieces), 1);
}

TEST(RowPieces, AtMostEightPiecesAndNoneUnderAWarpOfVectors) {
  // The combine's floor on pieces (EPX_COMBINE_MIN_PIECES) is clamped to this, so a short row is
  // never split into pieces with idle lanes.
  EXPECT_EQ(max_pieces_of(896), kMaxPieces);  // H = 7168, bf16
  EXPECT_EQ(max_pieces_of(512), kMaxPieces);  // H = 4096, bf16
  EXPECT_EQ(max_pieces_of(64), 2);
  EXPECT_EQ(max_pieces_of(63), 1);
  EXPECT_EQ(max_pieces_of(32), 1);
  EXPECT_EQ(max_pieces_of(12), 1);
  EXPECT_EQ(max_pieces_of(0), 1);
  for (int64_t nvec = 0; nvec <= 2100; ++nvec) {
    const int p = max_pieces_of(nvec);
    ASSERT_GE(p, 1) << nvec;
    ASSERT_LE(p, kMaxPieces) << nvec;
    if (p > 1) {
      ASSERT_GE(nvec / p, 32) << nvec;  // every piece at least one vector per lane
    }
    // pieces_for never goes past it, whatever the idle warps
    ASSERT_LE(pieces_for(1, 1 << 20, nvec, kMaxPieces), p) << nvec;
  }
}

TEST(RowPieces, EveryPieceCountDividesTheArrivalUnit) {
  for (int pieces = 1; pieces <= kMaxPieces; ++pieces) {
    EXPECT_EQ(kArrivalUnit % pieces, 0u) << pieces;
    EXPECT_EQ(kArrivalUnit / pieces * pieces, kArrivalUnit) << pieces;
  }
}


TEST(RowPieces, QueueHandsOutEveryPieceOfEveryRowOnce) {
  // The combine's reduce queue: rows in order, the head in `pieces` pieces, the tail in finer ones;
  // every (row, piece) exactly once, pieces of a row consecutive, and each row's share of the arrival
  // (kArrivalUnit / of) adds up to one unit.
  for (int items : {0, 1, 7, 64, 8192})
    for (int head : {0, 1, items / 2, items})
      for (int pieces : {1, 2, 3})
        for (int tail : {1, 2, 4, 8}) {
          if (head > items) continue;
          const PieceQueue q{items, head, pieces, tail};
          std::vector<int> seen(static_cast<size_t>(items) * kMaxPieces, 0);
          std::vector<uint32_t> units(static_cast<size_t>(items), 0);
          int last_item = -1, last_piece = -1;
          for (int e = 0; e < q.length(); ++e) {
            int item = -1, piece = -1, of = 0;
            q.at(e, item, piece, of);
            ASSERT_GE(item, 0);
            ASSERT_LT(item, items);
            ASSERT_EQ(of, item < head ? pieces : tail) << "items " << items << " head " << head << " entry " << e;
            ASSERT_LT(piece, of);
            if (item == last_item) ASSERT_EQ(piece, last_piece + 1);
            else ASSERT_EQ(piece, 0);
            ASSERT_GE(item, last_item);
            last_item = item;
            last_piece = piece;
            ++seen[static_cast<size_t>(item) * kMaxPieces + piece];
            units[static_cast<size_t>(item)] += kArrivalUnit / of;
          }
          for (int i = 0; i < items; ++i) {
            ASSERT_EQ(units[static_cast<size_t>(i)], kArrivalUnit) << "row " << i;
            const int of = i < head ? pieces : tail;
            for (int p = 0; p < of; ++p) ASSERT_EQ(seen[static_cast<size_t>(i) * kMaxPieces + p], 1);
          }
        }
}

}  // namespace
}  // namespace epx::comm
