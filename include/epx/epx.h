// Everything public in one include.
#pragma once

#include "epx/comm.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "epx/layout.h"
#include "epx/moe.h"
#include "epx/presets.h"
#include "epx/quant.h"
#include "epx/router.h"
#include "epx/tensor.h"
