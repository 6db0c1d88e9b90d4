#!/usr/bin/env bash
# The whole GPU check in one call on a GPU machine: configure + build (Release, ninja), the GPU
# test suite, compute-sanitizer memcheck over the GPU tests, and every benchmark beside its PyTorch
# baseline. Results go under $OUT (default ./gpu-out): gpu_tests.log/.json, memcheck.log,
# bench.jsonl (one JSON object per line), build.log, summary.txt.
#
# usage: scripts/gpu_check.sh [build] [ncu] [router] [tests] [mptests] [memcheck] [bench] [gemm] [fp8] [forward]
#                            [epbench] [eptrace] [scaling]
#                            [layer] [pipeline] [profile] [python] [pip] [pybench] [jaxbench] [abbuild] [ab] [gemmab]
#                            [pack]
#   (default: build tests memcheck bench; mptests and epbench need 2 GPUs; layer runs `epx demo`
#   and `epx bench layer` on every GPU beside the PyTorch layer, writing demo.log and layer.jsonl)
# BENCHES="bench_router bench_permute" narrows the bench step to those binaries; SKIP_TORCH_KERNELS=1
# leaves out the PyTorch kernel baselines.
# EPX_TEST_FILTER and MEMCHECK_FILTER narrow the GPU tests (gtest filter syntax; memcheck leaves out
# the long multi-GPU scenario sweep and the timing-based late-rank test unless MEMCHECK_FILTER says;
# MEMCHECK_TIMEOUT, default 300 s, bounds it).
# mptests runs the one-process-per-GPU suite three times: both transports (multigpu.log), then
# EPX_TRANSPORT=staged (multigpu_staged.log), then staged with NCCL's P2P and shared-memory
# transports disabled, so the exchange goes through NCCL's socket transport over loopback
# (multigpu_staged_net.log).
# (multigpu_staged_exact.log: the staged transport again with EPX_STAGED_SIZES=exact.)
# MP_RANKS (default 2) sets the ranks of the multi-process suite; MP_RUNS="plain staged net exact"
# picks which of its four runs happen ("mismatch" adds two ranks started with different zero-copy
# protocol settings, which must both fail at creation naming the setting). EP_TOKENS="4096 128" makes
# epbench run bench_ep and the PyTorch dispatch/combine at those token counts only (H=7168, E=256), on
# every local GPU: bench_ep with its default budget of 32 SMs on both transports, without a budget
# (--sms 0), and staged with exact sizes.
# EP_LAUNCH=process runs bench_ep there one process per GPU (scripts/run_ranks.sh) instead of one
# process driving every GPU.
# EPX_* variables reach every step: `EPX_EP_BARRIER=launch scripts/gpu_check.sh build tests mptests`
# runs the suites with the EP ops' opening barrier in a launch of its own (the default holds it inside
# the op's launch).
# eptrace (2+ GPUs) traces bench_ep at EPTRACE_TOKENS tokens (default 128) with Nsight Systems and
# writes per-kernel and timeline CSVs (eptrace_*.csv).
# pack (last) leaves one archive of everything under $OUT, results.tgz.
# abbuild builds the commit that scripts/ab_base.sh put into .carry/base (its epx CLI, into BASE_BUILD,
# default build-base, beside the build step's build), and ab times `epx bench layer` on that build and
# on this one in the same call: AB_ROUNDS rounds (default 2) over AB_PRESETS (default deepseek-v3
# mixtral), the two builds' order swapped every round, AB_ARGS added to every run; AB_PROFILE=1 adds
# one EPX_PROFILE run of each. ab.jsonl (and ab_profile.jsonl) carry a "build" field; the summary gives
# each preset's mean times and this build's ratio to the base, and with AB_PROFILE the phases that moved.
# epab times bench_ep variants (environment settings, or the abbuild step's base build) in one call: see
# the step for EPAB_VARIANTS, EPAB_SHAPES and EPAB_ROUNDS, e.g.
#   EPAB_VARIANTS="base:- this:- off:EPX_COMBINE_TAIL_PIECES=1" scripts/gpu_check.sh build abbuild epab
# (abbuild also builds the base's bench_ep; BASE_TARGETS narrows what it builds, e.g. "bench_grouped_gemm").
# gemmab times bench_grouped_gemm of the abbuild step's base build and of this build in one call, rounds in
# swapped order: GEMMAB_MODE (--fp8, the default, or --forward), GEMMAB_CASES (its --cases list, default the
# DeepSeek-V3 FC1 / FC2 shapes with 256 rows an expert), GEMMAB_ROUNDS (default 2); gemmab.jsonl tags each
# line with its build and round, and the summary gives each case's and schedule's times per build, e.g.
#   scripts/ab_base.sh main; then on the GPU machine: scripts/gpu_check.sh build abbuild gemmab
# pipeline benches the layer's chunked pipeline and communication overlap (PIPELINES, see the step).
# SKIP_DEMO=1 leaves `epx demo` out of the layer step; TORCH_LAYER="deepseek-v3" narrows its
# PyTorch layers (default: deepseek-v3 mixtral).
# router is the router's whole check in one step, for a build of the two binaries it needs
# (`TARGETS="epx_tests_gpu bench_router" scripts/gpu_check.sh build router`): the router GPU tests
# (router_tests.log), memcheck over the lean and split kernels' tests (router_memcheck.log), bench_router
# beside PyTorch's two routes (router.jsonl), and, where Nsight Compute is installed, a report of the split,
# lean and wide kernels at T = 16384 for softmax top-8 and DeepSeek-V3
# (ncu_router_{split,lean,wide}_{softmax,dsv3}.*).
# ncu profiles the router's and prepare's kernels with Nsight Compute (T = 16384 softmax top-8 and the
# DeepSeek-V3 router, fp32 logits; T = 4096 prepare) and writes each report's details and per-instruction SASS counters as text.
# python runs the Python package's pytest suites from the build tree (python_tests.log; PY_TESTS narrows
# them, e.g. "tests/python/test_torch.py"); pip checks `pip install .` (no build isolation, CPU-fast
# build without CUTLASS) into a scratch folder and runs epx.torch from there (pip.log); pybench runs
# bench/torch_moe_bench.py: epx.torch.MoE beside `epx bench layer` and the PyTorch layer (torch_moe.jsonl;
# PYBENCH_ARGS adds options, e.g. "--presets deepseek-v3"); jaxbench runs examples/jax_train_step.py (five
# training steps per preset of JAX_EXAMPLE_PRESETS, default "deepseek-v3 mixtral"; jax_train_step.jsonl), then
# bench/jax_moe_bench.py: the epx.jax layer under jit + shard_map beside the pure-JAX MoE baseline
# (jax_moe.jsonl; JAXBENCH_ARGS adds options, e.g. "--trace $OUT/jaxtrace" for a profiler trace of each
# run, summarised by bench/trace_summary.py).
# GoogleTest comes from .carry/googletest when the machine has none (copy /usr/src/googletest there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests memcheck bench)
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
# bench_ep_ranks N SECONDS LOG ARGS...: bench_ep with one process per GPU on N ranks, as a job launcher
# starts them (scripts/run_ranks.sh): every rank's output appended to LOG, rank 0's JSON lines on stdout.
bench_ep_ranks() {
  local n=$1 secs=$2 log=$3
  shift 3
  timeout "$secs" scripts/run_ranks.sh "$n" "$BUILD/bin/bench_ep" "$@" 2>&1 | tee -a "$log" | sed -n 's/^\[rank 0\] {/{/p'
}
# torch_layer PRESET OUT_FILE ERR_FILE: the PyTorch layer baseline at a preset's shape, T=4096 a rank,
# its JSON line appended to OUT_FILE (false where it failed or the preset has no PyTorch shape).
torch_layer() {
  local shape
  case $1 in
    deepseek-v3) shape="--hidden 7168 --experts 256 --topk 8 --ffn 2048" ;;
    mixtral) shape="--hidden 4096 --experts 8 --topk 2 --ffn 14336" ;;
    *) return 1 ;;
  esac
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/torch_layer_baseline.py --baseline .carry/bench/torch_ep_baseline.py \
    --tokens 4096 $shape --modes layer --iters 10 >>"$2" 2>>"$3"
}

summary "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tr '\n' ';')"

gt=()
[ -d .carry/googletest ] && gt=(-DEPX_GTEST_SOURCE="$PWD/.carry/googletest")
BASE_BUILD=${BASE_BUILD:-build-base}
if has abbuild; then
  if [ ! -f .carry/base/.ab_commit ]; then
    summary "abbuild: no .carry/base (scripts/ab_base.sh COMMIT puts one there)"
    exit 1
  fi
  # In the background, beside the build step's build (the two share the machine's cores).
  (
    t0=$(date +%s)
    if cmake -S .carry/base -B "$BASE_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DEPX_CUTLASS_DIR="$PWD/.carry/cutlass/include" "${gt[@]}" >"$OUT/build_base.log" 2>&1 &&
       cmake --build "$BASE_BUILD" -j "$JOBS" --target ${BASE_TARGETS:-epx_cli bench_ep bench_grouped_gemm} \
         >>"$OUT/build_base.log" 2>&1; then
      summary "abbuild: base $(cut -c1-12 .carry/base/.ab_commit) ok in $(( $(date +%s) - t0 )) s"
    else
      grep -E "error|Error" -A4 "$OUT/build_base.log" | head -30
      summary "abbuild: FAILED (build_base.log)"
    fi
  ) &
  base_pid=$!
fi

if has build; then
  t0=$(date +%s)
  # CMAKE_EXTRA (e.g. -DEPX_WITH_CUTLASS=OFF) and TARGETS (e.g. "epx_tests_gpu bench_router") narrow
  # a build to what a quick check needs; CMAKE_EXTRA=-DEPX_GEMM_TRIALS=ON adds the candidate grouped
  # GEMM kernels bench_grouped_gemm times beside the shipped ones.
  tg=()
  for t in ${TARGETS:-}; do tg+=(--target "$t"); done
  if ! cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${gt[@]}" ${CMAKE_EXTRA:-} >"$OUT/build.log" 2>&1 ||
     ! cmake --build "$BUILD" -j "$JOBS" "${tg[@]}" >>"$OUT/build.log" 2>&1; then
    grep -E "error|Error" -A4 "$OUT/build.log" | head -60
    summary "build: FAILED"
    exit 1
  fi
  summary "build: ok in $(( $(date +%s) - t0 )) s"
fi
[ -n "${base_pid:-}" ] && wait "$base_pid"

if has ncu; then
  if command -v ncu >/dev/null 2>&1; then
    ncu_one() {  # ncu_one NAME KERNEL_REGEX COUNT command...
      local name=$1 rx=$2 cnt=$3
      shift 3
      timeout 300 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
        -k "regex:$rx" -c "$cnt" -f -o "$OUT/ncu_$name" "$@" >"$OUT/ncu_$name.run.log" 2>&1 ||
        summary "ncu $name: rc=$?"
      ncu -i "$OUT/ncu_$name.ncu-rep" --page details >"$OUT/ncu_$name.details.txt" 2>&1
      ncu -i "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu_$name.sass.csv" 2>&1
      rm -f "$OUT/ncu_$name.ncu-rep"
    }
    # NCU_WHAT narrows the reports (default: router_softmax router_sigmoid layout).
    what=" ${NCU_WHAT:-router_softmax router_sigmoid layout} "
    rk=${NCU_ROUTER_KERNEL:-route_forward_wide_kernel<.int.16, float, .int.}
    [[ $what == *" router_softmax "* ]] && ncu_one router_softmax "${rk}0>" 1 "$BUILD/bin/bench_router"
    [[ $what == *" router_sigmoid "* ]] && ncu_one router_sigmoid "${rk}2>" 1 "$BUILD/bin/bench_router"
    [[ $what == *" layout "* ]] && ncu_one layout layout_kernel 1 "$BUILD/bin/bench_layout" --tokens 4096 --experts 256 --topk 8
    summary "ncu: $(ls "$OUT"/ncu_*.details.txt 2>/dev/null | wc -l) reports"
  else
    summary "ncu: not found"
  fi
fi

if has router; then
  timeout 900 "$BUILD/tests/epx_tests_gpu" --gtest_filter='RouterGpu*' >"$OUT/router_tests.log" 2>&1
  summary "router tests: rc=$? $(grep -E '^\[  PASSED' "$OUT/router_tests.log" | head -1) $(grep -E '^\[  FAILED  \] [0-9]+ test' "$OUT/router_tests.log" | head -1)"
  grep -E "Failure" -A6 "$OUT/router_tests.log" | head -60
  if command -v compute-sanitizer >/dev/null 2>&1; then
    timeout 600 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/epx_tests_gpu" \
      --gtest_filter='RouterGpu*Lean*:RouterGpuForward.MatchesReferenceOnTiesAndNonFiniteRows' >"$OUT/router_memcheck.log" 2>&1
    summary "router memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/router_memcheck.log" | tail -1)"
  fi
  timeout 300 "$BUILD/bin/bench_router" >"$OUT/router.jsonl" 2>>"$OUT/bench.err" || summary "router bench: rc=$?"
  PYTHONUNBUFFERED=1 timeout 180 python3 bench/torch_kernels_baseline.py --ops router >>"$OUT/router.jsonl" 2>>"$OUT/bench.err" ||
    summary "router bench: torch baseline failed"
  # The T = 16384 fp32 lines with statistics on random rows, side by side (the targets' shapes).
  grep '"op":"route_forward"' "$OUT/router.jsonl" | grep '"T":16384' | grep '"dtype":"fp32"' | grep '"stats":"global+z"' |
    grep -v '"rows":"separated"' |
    sed -E 's/.*"case":"([^"]*)".*"kernel":"([^"]*)".*"us":([0-9.]+),.*"hbm_fraction":([0-9.]+).*/\1 \2 \3 us \4 HBM/' | tee -a "$OUT/summary.txt"
  if command -v ncu >/dev/null 2>&1; then
    ncu_router() {  # ncu_router NAME KERNEL_REGEX: the bench's first launch of that kernel
      timeout 300 ncu --clock-control none --set full --import-source no --kernel-name-base demangled -k "regex:$2" -c 1 \
        -f -o "$OUT/ncu_router_$1" "$BUILD/bin/bench_router" >"$OUT/ncu_router_$1.run.log" 2>&1 || summary "ncu $1: rc=$?"
      ncu -i "$OUT/ncu_router_$1.ncu-rep" --page details >"$OUT/ncu_router_$1.details.txt" 2>&1
      # Where the warps wait: the stall reasons per issued instruction (the details page draws them only as a chart).
      ncu -i "$OUT/ncu_router_$1.ncu-rep" --page raw 2>&1 | grep -E "average_warps_issue_stalled_.*per_issue_active" |
        sort -k3 -g -r | head -14 >>"$OUT/ncu_router_$1.details.txt"
      rm -f "$OUT/ncu_router_$1.ncu-rep"
    }
    # Demangled template arguments may read (int)8 or (bool)1: the patterns allow either spelling.
    ncu_router split_softmax 'route_forward_split_kernel<[^,]*256, [^,]*0, [^,]*(false|0), [^,]*0>'
    ncu_router split_dsv3 'route_forward_split_kernel<[^,]*256, [^,]*2, [^,]*(true|1), [^,]*2>'
    ncu_router lean_softmax 'route_forward_lean_kernel<[^,]*8, [^,]*0, [^,]*3, [^,]*(false|0), [^,]*(false|0)>'
    ncu_router lean_dsv3 'route_forward_lean_kernel<[^,]*8, [^,]*2, [^,]*3, [^,]*(true|1), [^,]*(true|1)>'
    ncu_router wide_softmax 'route_forward_wide_kernel<[^,]*16, float, [^,]*0>'
    ncu_router wide_dsv3 'route_forward_wide_kernel<[^,]*16, float, [^,]*2>'
    summary "router ncu: $(ls "$OUT"/ncu_router_*.details.txt 2>/dev/null | wc -l) reports"
  fi
fi

if has tests; then
  # Bounded, so that a hang (a collective some rank never joins) ends the step instead of the whole check.
  # EPX_TEST_FILTER is this script's, not the library's: the tests do not see it (epx warns about EPX_*
  # names it does not read).
  timeout --kill-after=30 "${GPU_TESTS_TIMEOUT:-1200}" env -u EPX_TEST_FILTER \
    "$BUILD/tests/epx_tests_gpu" --gtest_filter="${EPX_TEST_FILTER:-*}" --gtest_output="json:$OUT/gpu_tests.json" >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED|SKIPPED) " "$OUT/gpu_tests.log" | sort | uniq -c | tail -20
  grep -E "Failure|error" -A6 "$OUT/gpu_tests.log" | head -80
  summary "gpu tests: rc=$rc $(grep -E '^\[  PASSED' "$OUT/gpu_tests.log" | head -1) $(grep -E '^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests.log" | head -1)"
fi

if has memcheck; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$BUILD/tests/epx_tests_gpu" --gtest_filter="${MEMCHECK_FILTER:-*-*StandardScenarios*:*LateRank*}" >"$OUT/memcheck.log" 2>&1
    rc=$?
    summary "memcheck: rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  else
    summary "memcheck: compute-sanitizer not found"
  fi
fi

if has bench; then
  : >"$OUT/bench.jsonl"
  for b in "$BUILD"/bin/bench_*; do
    [ -x "$b" ] || continue
    if [ "$(basename "$b")" = bench_ep ] && has epbench; then continue; fi  # the epbench step runs it
    if [ -n "${BENCHES:-}" ] && ! [[ " $BENCHES " == *" $(basename "$b") "* ]]; then continue; fi
    timeout "${BENCH_TIMEOUT:-120}" "$b" >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err" || summary "bench: $(basename "$b") failed rc=$?"
  done
  if [ -z "${SKIP_TORCH_KERNELS:-}" ]; then
    PYTHONUNBUFFERED=1 timeout 180 python3 bench/torch_kernels_baseline.py --ops "${TORCH_OPS:-router,permute,quant}" >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err" ||
      summary "bench: torch baseline failed"
  fi
  summary "bench: $(wc -l <"$OUT/bench.jsonl") JSON lines"
  cat "$OUT/bench.jsonl"
fi

if has gemm; then
  # bench_grouped_gemm between two runs of torch._grouped_mm (the clocks drift between runs, so ratios
  # are taken within one call), then every wgrad kernel in one interleaved contest per shape of
  # GEMM_WGRAD_CASES (default: the DeepSeek-V3 shapes on 2 GPUs, fc1 fc2; fc1_r128 fc2_r128 are the
  # one-GPU layer's). In a build with -DEPX_GEMM_TRIALS=ON the candidate kernels and tile orders
  # join: gemm.jsonl.
  : >"$OUT/gemm.jsonl"
  python3 bench/torch_grouped_mm_baseline.py >>"$OUT/gemm.jsonl" 2>>"$OUT/gemm.err" ||
    summary "gemm: torch baseline failed"
  timeout "${GEMM_TIMEOUT:-400}" "$BUILD/bin/bench_grouped_gemm" >>"$OUT/gemm.jsonl" 2>>"$OUT/gemm.err" ||
    summary "gemm: bench_grouped_gemm failed rc=$?"
  python3 bench/torch_grouped_mm_baseline.py >>"$OUT/gemm.jsonl" 2>>"$OUT/gemm.err" ||
    summary "gemm: torch baseline failed"
  for c in ${GEMM_WGRAD_CASES:-fc1 fc2}; do
    timeout 300 "$BUILD/bin/bench_grouped_gemm" --wgrad "$c" trials >>"$OUT/gemm.jsonl" 2>>"$OUT/gemm.err" ||
      summary "gemm: wgrad contest $c failed rc=$?"
  done
  summary "gemm: $(wc -l <"$OUT/gemm.jsonl") JSON lines"
fi

if has fp8; then
  # The FP8 grouped forward alone: its GPU tests (in a build with -DEPX_GEMM_TRIALS=ON also every
  # candidate schedule, each bit-compared with the shipped schedule it derives from), memcheck over
  # the blockwise test, and `bench_grouped_gemm --fp8`: the bf16 forward, the FP8 schedules and the
  # candidates in one interleaved contest per shape (fp8.jsonl).
  timeout 600 "$BUILD/tests/epx_tests_gpu" --gtest_filter='GroupedGemmGpu.Fp8*:ExpertMlpGpu.Fp8*:MoELayerGpu.*Fp8*' \
    >"$OUT/fp8_tests.log" 2>&1
  rc=$?
  summary "fp8 tests: rc=$rc $(grep -E '^\[  PASSED' "$OUT/fp8_tests.log" | head -1)" \
    "$(grep -E '^\[  FAILED  \] [0-9]+ test' "$OUT/fp8_tests.log" | head -1)"
  grep -E "Failure" -A6 "$OUT/fp8_tests.log" | head -40
  if command -v compute-sanitizer >/dev/null 2>&1; then
    timeout 600 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/epx_tests_gpu" \
      --gtest_filter='GroupedGemmGpu.Fp8BlockwiseForwardMatchesReference:GroupedGemmGpu.Fp8ContiguousGroupsMatchCooperative' >"$OUT/fp8_memcheck.log" 2>&1
    summary "fp8 memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/fp8_memcheck.log" | tail -1)"
  fi
  timeout "${GEMM_TIMEOUT:-400}" "$BUILD/bin/bench_grouped_gemm" --fp8 >"$OUT/fp8.jsonl" 2>>"$OUT/gemm.err" ||
    summary "fp8: bench_grouped_gemm --fp8 failed rc=$?"
  summary "fp8: $(wc -l <"$OUT/fp8.jsonl") JSON lines"
  # schedule, case, speed-up over bf16, elements differing from cooperative
  rx='.*"elements_differing_from_cooperative":(-?[0-9]+).*"schedule":"([^"]*)","case":"([^"]*)"'
  sed -E "s/$rx"'.*"speedup_vs_bf16":([0-9.]+).*/\3 \2 \4x bf16, \1 differing/' "$OUT/fp8.jsonl" | tee -a "$OUT/summary.txt"
fi

if has forward; then
  # The bf16 forward and dgrad against their candidates (a build with -DEPX_GEMM_TRIALS=ON), one
  # interleaved contest per shape and mode in the default tile order: forward.jsonl.
  timeout "${GEMM_TIMEOUT:-400}" "$BUILD/bin/bench_grouped_gemm" --forward >"$OUT/forward.jsonl" 2>>"$OUT/gemm.err" ||
    summary "forward: bench_grouped_gemm --forward failed rc=$?"
  summary "forward: $(wc -l <"$OUT/forward.jsonl") JSON lines"
  # case, op, schedule, shipped time over the candidate's, elements differing from the shipped kernel
  rx='.*"op":"grouped_gemm_([a-z]+)_kernel","case":"([^"]*)","schedule":"([^"]*)".*"shipped_over_trial_time":'
  rx+='([0-9.]+)(,"elements_differing_from_shipped":([0-9]+))?.*'
  sed -E "s/$rx/\2 \1 \3 \4 \6/" "$OUT/forward.jsonl" | tee -a "$OUT/summary.txt"
fi

if has mptests; then
  # run_mp LABEL LOG [VAR=VALUE...]: the multi-process suite on 2 ranks with extra environment.
  run_mp() {
    local label=$1 log=$2
    shift 2
    env "$@" timeout --kill-after=15 420 scripts/run_ranks.sh "${MP_RANKS:-2}" "$BUILD/tests/epx_tests_multigpu" >"$OUT/$log" 2>&1
    local rc=$?
    grep -E "Failure|error" -A6 "$OUT/$log" | head -40
    summary "multi-process tests (${MP_RANKS:-2} ranks, $label): rc=$rc $(grep -E '\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$log" | sed 's/^\[rank [0-9]*\] //' | sort | uniq -c | tr -s ' ' | tr '\n' ' ')"
  }
  runs=" ${MP_RUNS:-plain staged net exact} "
  [[ $runs == *" plain "* ]] && run_mp "zero-copy and staged" multigpu.log
  [[ $runs == *" staged "* ]] && run_mp "EPX_TRANSPORT=staged" multigpu_staged.log EPX_TRANSPORT=staged
  [[ $runs == *" net "* ]] && run_mp "EPX_TRANSPORT=staged over NCCL sockets on loopback" multigpu_staged_net.log \
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo EPX_TRANSPORT=staged
  [[ $runs == *" exact "* ]] && run_mp "EPX_TRANSPORT=staged EPX_STAGED_SIZES=exact" multigpu_staged_exact.log \
    EPX_TRANSPORT=staged EPX_STAGED_SIZES=exact
  # mismatch: two ranks whose zero-copy protocol settings differ must both fail at creation with an
  # error naming the setting (bench_ep creates the group), not time out at the first op.
  if [[ $runs == *" mismatch "* ]]; then
    for var in EPX_PREPARE_HEADERS=one EPX_EP_BARRIER=launch; do
      log="$OUT/multigpu_mismatch_${var%%=*}.log"
      timeout --kill-after=5 90 scripts/run_ranks.sh 2 bash -c "[ \"\$RANK\" = 1 ] && export $var; \
        exec $BUILD/bin/bench_ep --tokens 128 --sms 0 --transport zerocopy" >"$log" 2>&1
      rc=$?
      named=$(grep -c "${var%%=*}" "$log")
      if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] && [ "$named" -ge 2 ]; then
        summary "multi-process mismatch ($var on rank 1): ok, rc=$rc, both ranks named ${var%%=*}"
      else
        summary "multi-process mismatch ($var on rank 1): FAILED rc=$rc, lines naming ${var%%=*}: $named"
      fi
    done
  fi
fi

if has epbench; then
  [ -f "$OUT/bench.jsonl" ] || : >"$OUT/bench.jsonl"
  # bench_ep SECONDS ARGS...: one process driving every GPU, or with EP_LAUNCH=process one process per
  # GPU (every rank's output in bench_ep_ranks.log).
  bench_ep() {
    local secs=$1
    shift
    if [ "${EP_LAUNCH:-}" = process ]; then
      bench_ep_ranks "$(nvidia-smi -L | wc -l)" "$secs" "$OUT/bench_ep_ranks.log" "$@"
    else
      timeout "$secs" "$BUILD/bin/bench_ep" "$@"
    fi
  }
  shapes=("--tokens 4096 --hidden 7168 --experts 256" "--tokens 128 --hidden 7168 --experts 256"
          "--tokens 4096 --hidden 4096 --experts 64")
  if [ -n "${EP_TOKENS:-}" ]; then
    shapes=()
    for t in $EP_TOKENS; do
      shapes+=("--tokens $t --hidden 7168 --experts 256")
      bench_ep 300 --tokens "$t" --transport both >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err" ||
        summary "bench_ep --tokens $t failed rc=$?"
      # without an SM budget: 32 blocks drive the link, the receive side takes every SM
      bench_ep 120 --tokens "$t" --transport zerocopy --sms 0 >>"$OUT/bench.jsonl" \
        2>>"$OUT/bench.err" || summary "bench_ep --tokens $t --sms 0 failed rc=$?"
      # the staged transport moving only the slots each peer needs
      EPX_STAGED_SIZES=exact bench_ep 120 --tokens "$t" --transport staged >>"$OUT/bench.jsonl" \
        2>>"$OUT/bench.err" || summary "bench_ep --tokens $t (staged, exact sizes) failed rc=$?"
    done
  else
    bench_ep 480 --transport both >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err" || summary "bench_ep failed rc=$?"
  fi
  if [ -f .carry/bench/torch_ep_baseline.py ]; then
    for shape in "${shapes[@]}"; do
      PYTHONUNBUFFERED=1 timeout 240 python3 .carry/bench/torch_ep_baseline.py $shape --modes dc --iters 10 \
        >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err" || summary "torch_ep_baseline failed for $shape"
    done
  fi
  grep -E 'dispatch' "$OUT/bench.jsonl"
fi
if has layer; then
  if [ -z "${SKIP_DEMO:-}" ]; then
    timeout 400 "$BUILD/bin/epx" demo >"$OUT/demo.log" 2>&1
    rc=$?
    tail -12 "$OUT/demo.log"
    summary "demo: rc=$rc $(tail -1 "$OUT/demo.log" | cut -c1-400)"
  fi
  : >"$OUT/layer.jsonl"
  timeout 400 "$BUILD/bin/epx" bench layer ${LAYER_ARGS:-} >>"$OUT/layer.jsonl" 2>>"$OUT/layer.err" ||
    summary "epx bench layer failed rc=$?"
  # The FP8 forwards of the expert GEMMs: the block recipe with and without the weight cache, and
  # MXFP8 (LAYER_FP8_PRESETS=" " leaves them out).
  for preset in ${LAYER_FP8_PRESETS:-deepseek-v3 mixtral}; do
    for variant in "fp8_block 0" "fp8_block 1" "mxfp8 0"; do
      read -r prec cache <<<"$variant"
      timeout 200 "$BUILD/bin/epx" bench layer --preset "$preset" --precision "$prec" --fp8-weight-cache "$cache" \
        >>"$OUT/layer.jsonl" 2>>"$OUT/layer.err" || summary "epx bench layer $prec ($preset, cache $cache) failed rc=$?"
    done
  done
  if [ -f .carry/bench/torch_ep_baseline.py ]; then
    for preset in ${TORCH_LAYER:-deepseek-v3 mixtral}; do
      torch_layer "$preset" "$OUT/layer.jsonl" "$OUT/layer.err" || summary "torch layer baseline failed for $preset"
    done
  fi
  cat "$OUT/layer.jsonl"
fi
if has pipeline; then
  # MoEConfig::pipeline_chunks / overlap_communication against the plain layer, in one process run
  # after another on the same machine: "chunks overlap sms" per variant (PIPELINES), for
  # PIPELINE_PRESETS (default deepseek-v3); "1 0 0" is the plain layer. pipeline.jsonl.
  : >"$OUT/pipeline.jsonl"
  while read -r chunks overlap sms; do
    [ -z "$chunks" ] && continue
    timeout 300 "$BUILD/bin/epx" bench layer --preset "${PIPELINE_PRESETS:-deepseek-v3}" --chunks "$chunks" \
      --overlap "$overlap" --sms "$sms" ${PIPELINE_ARGS:-} >>"$OUT/pipeline.jsonl" 2>>"$OUT/pipeline.err" ||
      summary "epx bench layer --chunks $chunks --overlap $overlap --sms $sms failed rc=$?"
  done <<<"$(echo "${PIPELINES:-1 0 0,1 1 0,1 1 32,2 1 0,2 1 32,4 1 32}" | tr ',' '\n')"
  cat "$OUT/pipeline.jsonl"
fi
if has profile; then
  # Where the layer's time goes: EPX_PROFILE=1 records stream events between the layer's phases.
  EPX_PROFILE=1 timeout 300 "$BUILD/bin/epx" bench layer --preset "${PROFILE_PRESET:-deepseek-v3,mixtral}" --iters 5 \
    >"$OUT/profile.jsonl" 2>"$OUT/profile.err" || summary "profile failed rc=$?"
  cat "$OUT/profile.jsonl"
fi
if has epab; then
  # bench_ep variants in one call, rounds in swapped order: EPAB_VARIANTS="name:VAR=VAL,VAR=VAL ..." ("-": no
  # variables; a name starting with "base" runs the abbuild step's bench_ep), EPAB_SHAPES="T:H:E[:SMS] ..."
  # (SMS: the SM budget, default 0 = none), EPAB_ROUNDS (default 2). Zero-copy only; epab.jsonl tags each
  # line with its variant and round, and the summary gives each shape's prepare / dispatch / combine times.
  : >"$OUT/epab.jsonl"
  vs=(${EPAB_VARIANTS:-"this:-"})
  for round in $(seq "${EPAB_ROUNDS:-2}"); do
    order=("${vs[@]}")
    if [ $((round % 2)) -eq 0 ]; then
      order=()
      for ((i = ${#vs[@]} - 1; i >= 0; i--)); do order+=("${vs[$i]}"); done
    fi
    for shape in ${EPAB_SHAPES:-4096:7168:256}; do
      IFS=: read -r T H E SMS <<<"$shape"
      for v in "${order[@]}"; do
        name=${v%%:*} spec=${v#*:} bin=$BUILD/bin/bench_ep envs=()
        [[ $name == base* ]] && bin=$BASE_BUILD/bin/bench_ep
        [ "$spec" != "-" ] && IFS=',' read -ra envs <<<"$spec"
        env "${envs[@]}" timeout 120 "$bin" --tokens "$T" --hidden "$H" --experts "$E" --sms "${SMS:-0}" \
          --transport zerocopy 2>>"$OUT/epab.err" | grep '^{' |
          sed "s/^{/{\"variant\":\"$name\",\"round\":$round,/" >>"$OUT/epab.jsonl"
      done
    done
  done
  python3 - "$OUT/epab.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import collections, json, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if d.get("op") == "dispatch+combine":
        runs[(d["tokens"], d["hidden"], d["experts"], d.get("sm_budget", 0), d["variant"])].append(d)
for key in sorted(runs):
    f = lambda k: " / ".join("%.1f" % d[k] for d in runs[key] if k in d)
    print("epab T=%d H=%d E=%d sms=%d %s:" % key, "prepare", f("prepare_us"), "| dispatch", f("dispatch_us"),
          "| combine", f("combine_us"), "(graph", f("combine_graph_us") + ")",
          "| combine_backward", f("combine_backward_us"))
PY
fi

if has gemmab; then
  # Two binaries, so the rounds alternate them (the GEMMs run at the power cap, where the clock a run sees
  # depends on what ran before it: only times of one round, or means over swapped rounds, compare).
  : >"$OUT/gemmab.jsonl"
  cases=${GEMMAB_CASES:-dsv3_fc1_128x256_k7168_n4096,dsv3_fc2_128x256_k2048_n7168}
  for round in $(seq "${GEMMAB_ROUNDS:-2}"); do
    order="base this"
    [ $((round % 2)) -eq 0 ] && order="this base"
    for side in $order; do
      bin=$BUILD/bin/bench_grouped_gemm
      [ "$side" = base ] && bin=$BASE_BUILD/bin/bench_grouped_gemm
      timeout "${GEMM_TIMEOUT:-400}" "$bin" "${GEMMAB_MODE:---fp8}" --cases "$cases" 2>>"$OUT/gemmab.err" | grep '^{' |
        sed "s/^{/{\"build\":\"$side\",\"round\":$round,/" >>"$OUT/gemmab.jsonl" ||
        summary "gemmab: $side round $round failed"
    done
  done
  python3 - "$OUT/gemmab.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import collections, json, sys
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if "time_us" in d and "case" in d:
        t[(d["case"], d["op"], d.get("schedule", "-"), d["build"])].append(d["time_us"])
for case, op, sched in sorted({k[:3] for k in t}):
    base, this = t.get((case, op, sched, "base"), []), t.get((case, op, sched, "this"), [])
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    print("gemmab %s %s %s: base %s | this %s | base/this %.3f" % (case, op, sched, " / ".join("%.1f" % x for x in base),
          " / ".join("%.1f" % x for x in this), mean(base) / mean(this)))
PY
fi

if has ab; then
  base_tag="base:$(cut -c1-12 .carry/base/.ab_commit 2>/dev/null || echo unknown)"
  ab_run() {  # ab_run SIDE ROUND PRESET FILE [env...]: one `epx bench layer`, its lines tagged with the build
    local side=$1 round=$2 preset=$3 file=$4 bin=$BUILD/bin/epx tag=this
    shift 4
    [ "$side" = base ] && bin=$BASE_BUILD/bin/epx && tag=$base_tag
    env "$@" timeout 300 "$bin" bench layer --preset "$preset" ${AB_ARGS:-} 2>>"$OUT/ab.err" |
      sed "s/^{/{\"build\":\"$tag\",\"round\":$round,/" >>"$OUT/$file"
  }
  : >"$OUT/ab.jsonl"
  for round in $(seq "${AB_ROUNDS:-2}"); do
    order="base this"
    [ $((round % 2)) -eq 0 ] && order="this base"
    for preset in ${AB_PRESETS:-deepseek-v3 mixtral}; do
      for side in $order; do ab_run "$side" "$round" "$preset" ab.jsonl; done
    done
  done
  if [ -n "${AB_PROFILE:-}" ]; then
    : >"$OUT/ab_profile.jsonl"
    for preset in ${AB_PRESETS:-deepseek-v3 mixtral}; do
      for side in base this; do ab_run "$side" 1 "$preset" ab_profile.jsonl EPX_PROFILE=1; done
    done
  fi
  python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
from collections import defaultdict
out = sys.argv[1]
def lines(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.startswith("{")]
runs = defaultdict(list)
for d in lines("ab.jsonl"):
    runs[(d["preset"], d["build"] == "this")].append(d)
mean = lambda xs: sum(xs) / len(xs)
for preset in sorted({p for p, _ in runs}):
    base, this = runs.get((preset, False), []), runs.get((preset, True), [])
    if not base or not this:
        print(f"ab {preset}: missing runs (base {len(base)}, this {len(this)}); see ab.err")
        continue
    b, t = mean([d["fwd_bwd_us"] for d in base]), mean([d["fwd_bwd_us"] for d in this])
    bf, tf = mean([d["fwd_us"] for d in base]), mean([d["fwd_us"] for d in this])
    print(f"ab {preset}: fwd {bf / 1e3:.3f} -> {tf / 1e3:.3f} ms, fwd+bwd {b / 1e3:.3f} -> {t / 1e3:.3f} ms "
          f"(this / base {t / b:.4f}; runs: " + ", ".join(f"{d['fwd_bwd_us'] / 1e3:.2f}" for d in base) + " -> "
          + ", ".join(f"{d['fwd_bwd_us'] / 1e3:.2f}" for d in this) + ")")
prof = {(d["preset"], d["build"] == "this"): d for d in lines("ab_profile.jsonl")}
for preset in sorted({p for p, _ in prof}):
    base, this = prof.get((preset, False)), prof.get((preset, True))
    if not base or not this:
        continue
    pb, pt = base["phases_ms_total"], this["phases_ms_total"]
    moved = sorted(((pt.get(k, 0) / this["iters"] - pb.get(k, 0) / base["iters"], k) for k in set(pb) | set(pt)),
                   key=lambda x: -abs(x[0]))
    print(f"ab {preset} phases that moved most (ms an iteration, base -> this): " + "; ".join(
        f"{k} {pb.get(k, 0) / base['iters']:.3f} -> {pt.get(k, 0) / this['iters']:.3f}" for _, k in moved[:6]))
PY
fi
if has scaling; then
  # How the time per rank grows with the number of ranks, on one machine: for each R of SCALING_RANKS
  # (default "2 N", N = the visible GPUs) the first R GPUs run bench_ep, one process per GPU
  # (scripts/run_ranks.sh), at SCALING_TOKENS (default
  # "4096 128"; H=7168, E=256, K=8, both transports, 32-SM budget), the PyTorch dispatch/combine of
  # the same shapes, `epx bench layer` (both presets) with one EPX_PROFILE run of DeepSeek-V3 for the
  # phases, and the PyTorch layer; every line goes to scaling.jsonl (each carries its "ranks").
  ngpu=$(nvidia-smi -L | wc -l)
  default_ranks="2 $ngpu"
  [ "$ngpu" -le 2 ] && default_ranks=$ngpu
  : >"$OUT/scaling.jsonl"
  for r in ${SCALING_RANKS:-$default_ranks}; do
    if [ "$r" -gt "$ngpu" ]; then
      summary "scaling: $r ranks asked, $ngpu GPUs visible: skipped"
      continue
    fi
    vis=$(seq -s, 0 $((r - 1)))
    for t in ${SCALING_TOKENS:-4096 128}; do
      # one process per GPU, as a job launcher starts them; rank 0's lines
      log="$OUT/scaling_bench_ep_r${r}_t${t}.log"
      : >"$log"
      CUDA_VISIBLE_DEVICES=$vis bench_ep_ranks "$r" 300 "$log" --tokens "$t" --transport both >>"$OUT/scaling.jsonl" ||
        summary "scaling: bench_ep R=$r T=$t failed rc=$?"
      if [ -f .carry/bench/torch_ep_baseline.py ]; then
        CUDA_VISIBLE_DEVICES=$vis PYTHONUNBUFFERED=1 timeout 240 python3 .carry/bench/torch_ep_baseline.py \
          --tokens "$t" --hidden 7168 --experts 256 --modes dc --iters 10 >>"$OUT/scaling.jsonl" \
          2>>"$OUT/scaling.err" || summary "scaling: torch dispatch/combine R=$r T=$t failed"
      fi
    done
    CUDA_VISIBLE_DEVICES=$vis timeout 300 "$BUILD/bin/epx" bench layer --ranks "$r" >>"$OUT/scaling.jsonl" \
      2>>"$OUT/scaling.err" || summary "scaling: epx bench layer R=$r failed rc=$?"
    CUDA_VISIBLE_DEVICES=$vis EPX_PROFILE=1 timeout 300 "$BUILD/bin/epx" bench layer --ranks "$r" --preset deepseek-v3 \
      --iters 5 2>>"$OUT/scaling.err" | sed 's/^{/{"profile":true,/' >>"$OUT/scaling.jsonl"
    if [ -f .carry/bench/torch_ep_baseline.py ]; then
      for preset in deepseek-v3 mixtral; do
        CUDA_VISIBLE_DEVICES=$vis torch_layer "$preset" "$OUT/scaling.jsonl" "$OUT/scaling.err" ||
          summary "scaling: torch layer R=$r failed ($preset)"
      done
    fi
  done
  python3 - "$OUT/scaling.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for d in rows:
    R = d.get("ranks")
    if d.get("impl") == "torch" and "dispatch_us" in d:
        print(f"scaling R={R} T={d['tokens']} torch: dispatch {d['dispatch_us']:.1f} us, combine {d['combine_us']:.1f} us")
    elif d.get("op") == "dispatch+combine":
        print(f"scaling R={R} T={d['tokens']} {d['transport']}: dispatch {d['dispatch_us']:.1f} us, combine "
              f"{d['combine_us']:.1f} us, graph {d['dispatch_graph_us']:.1f} / {d['combine_graph_us']:.1f} us, "
              f"fp8 dispatch {d['fp8_dispatch_us']:.1f} us, remote rows {d['remote_rows']:.0f}, "
              f"registered {d['registered_bytes'] / 1e9:.3f} GB")
    elif d.get("bench") == "layer" and not d.get("profile"):
        print(f"scaling R={R} layer {d['preset']}: fwd {d['fwd_us'] / 1e3:.2f} ms, fwd+bwd {d['fwd_bwd_us'] / 1e3:.2f} ms, "
              f"{d['fwd_bwd_over_floor']:.2f}x floor, {d['gpu_mem_used_gb']:.2f} GB")
    elif d.get("impl") == "torch":
        print(f"scaling R={R} torch layer H={d.get('hidden')} E={d.get('experts')}: " +
              ", ".join(f"{k} {v}" for k, v in d.items() if k.endswith(("_ms", "_us", "_gb"))))
    elif d.get("profile"):
        n = d["iters"]
        print(f"scaling R={R} profile {d['preset']} (ms an iteration): " +
              "; ".join(f"{k} {v / n:.3f}" for k, v in sorted(d["phases_ms_total"].items(), key=lambda kv: -kv[1])))
PY
fi
if has eptrace; then
  # Where decode-sized EP ops spend their time: an Nsight Systems trace of bench_ep at EPTRACE_TOKENS
  # (default 128) tokens, summarised per kernel and as the GPU timeline (launch gaps included).
  if command -v nsys >/dev/null 2>&1; then
    timeout 240 nsys profile --trace cuda -f true -o "$OUT/eptrace" "$BUILD/bin/bench_ep" \
      --tokens "${EPTRACE_TOKENS:-128}" --transport zerocopy --sms 0 >"$OUT/eptrace.run.log" 2>&1 ||
      summary "eptrace: nsys rc=$?"
    for report in cuda_gpu_kern_sum cuda_gpu_trace; do
      nsys stats --report "$report" --format csv --output "$OUT/eptrace" "$OUT/eptrace.nsys-rep" \
        >>"$OUT/eptrace.stats.log" 2>&1 || summary "eptrace: nsys stats $report failed"
    done
    rm -f "$OUT/eptrace.nsys-rep" "$OUT/eptrace.sqlite"
    summary "eptrace: $(ls "$OUT"/eptrace_*.csv 2>/dev/null | wc -l) CSV reports"
  else
    summary "eptrace: nsys not found"
  fi
fi
if has python; then
  PYTHONPATH=$PWD/$BUILD/python PYTHONUNBUFFERED=1 timeout 540 python3 -m pytest -q -rs -p no:cacheprovider \
    ${PY_TESTS:-tests/python} >"$OUT/python_tests.log" 2>&1
  rc=$?
  tail -25 "$OUT/python_tests.log"
  summary "python tests: rc=$rc $(tail -1 "$OUT/python_tests.log")"
fi
if has pip; then
  t0=$(date +%s)
  rm -rf /tmp/epx-pip
  if timeout 400 python3 -m pip install --no-build-isolation --no-deps --target /tmp/epx-pip . \
       -Ccmake.define.EPX_WITH_CUTLASS=OFF -Cbuild-dir=/tmp/epx-pip-build \
       >"$OUT/pip.log" 2>&1; then
    (cd /tmp && PYTHONPATH=/tmp/epx-pip python3 -c "
import torch, epx, epx.torch as ept
g = ept.Group.local('cuda', num_experts=8, hidden=64, max_tokens_per_rank=32, max_topk=2)
idx, w = ept.Router(8, 2)(torch.randn(32, 8, device='cuda'))
print('pip-installed epx', epx.__version__, 'from', epx.__file__, '| group', g, '| route ok:', bool((idx >= 0).all()))
") >>"$OUT/pip.log" 2>&1
    rc=$?
  else
    rc=$?
  fi
  tail -3 "$OUT/pip.log"
  summary "pip install .: rc=$rc in $(( $(date +%s) - t0 )) s"
fi
if has pybench; then
  PYTHONPATH=$PWD/$BUILD/python PYTHONUNBUFFERED=1 timeout 560 python3 bench/torch_moe_bench.py --epx-cli "$BUILD/bin/epx" \
    --baseline .carry/bench/torch_ep_baseline.py ${PYBENCH_ARGS:-} >"$OUT/torch_moe.jsonl" 2>"$OUT/torch_moe.err" ||
    summary "torch_moe_bench failed rc=$?"
  cat "$OUT/torch_moe.jsonl"
fi
if has jaxbench; then
  # The example training loop first (Flax MoEBlock, SGD, expert-bias update), then the benchmark.
  for preset in ${JAX_EXAMPLE_PRESETS:-deepseek-v3 mixtral}; do
    PYTHONPATH=$PWD/$BUILD/python PYTHONUNBUFFERED=1 timeout 200 python3 examples/jax_train_step.py --preset "$preset" \
      --tokens 4096 --steps 5 >>"$OUT/jax_train_step.jsonl" 2>>"$OUT/jax_moe.err" || summary "jax_train_step $preset failed rc=$?"
  done
  cat "$OUT/jax_train_step.jsonl"
  PYTHONPATH=$PWD/$BUILD/python PYTHONUNBUFFERED=1 timeout 560 python3 bench/jax_moe_bench.py ${JAXBENCH_ARGS:-} \
    >"$OUT/jax_moe.jsonl" 2>>"$OUT/jax_moe.err" || summary "jax_moe_bench failed rc=$?"
  cat "$OUT/jax_moe.jsonl"
fi
cat "$OUT/summary.txt"
if has pack; then
  # Everything under $OUT in one archive, results.tgz (for runners that copy back only a few files).
  (cd "$OUT" && tar czf /tmp/epx-results.tgz --exclude=results.tgz . && find . -mindepth 1 -delete &&
    mv /tmp/epx-results.tgz results.tgz)
fi
