#include "epx/error.h"

namespace epx {

const char* status_name(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kCapacityExceeded: return "capacity exceeded";
    case Status::kNotSupported: return "not supported";
    case Status::kTimeout: return "timeout";
    case Status::kCudaError: return "CUDA error";
    case Status::kNcclError: return "NCCL error";
    case Status::kInternal: return "internal error";
  }
  return "unknown";
}

}  // namespace epx
