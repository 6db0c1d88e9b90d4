// How many SMs the grouped GEMMs launched from this thread may take. The grouped GEMMs are
// persistent (one CTA per SM looping over tiles), so a GEMM sized for every SM keeps the SMs a
// communication kernel beside it waits for until the whole GEMM ends; a layer that overlaps its
// collectives (with their own SM budget) with its GEMMs leaves them that budget here.
#pragma once

namespace epx::detail {

/// The limit for this thread; 0 = every SM of the device.
int gemm_sm_limit();

/// Sets the limit for a scope (0 lifts it) and restores the previous one after.
class GemmSmLimit {
 public:
  explicit GemmSmLimit(int sms);
  ~GemmSmLimit();
  GemmSmLimit(const GemmSmLimit&) = delete;
  GemmSmLimit& operator=(const GemmSmLimit&) = delete;

 private:
  int saved_;
};

}  // namespace epx::detail
