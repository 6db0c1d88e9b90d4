#!/usr/bin/env bash
# A/B of one benchmark binary over several versions of a few source files, in one GPU call: each version is
# the working tree with that version's files copied over it, built incrementally in one build folder (only
# the changed files recompile), and the binaries run in rounds whose order rotates, so every version sees the
# machine's drift alike. Faster than a second whole build (scripts/ab_base.sh) when a change touches a few
# kernel files.
#
# On the development machine, for each version other than the working tree (the GPU machine has no git):
#   scripts/kernel_ab.sh save base HEAD       # HEAD's version of every file the working tree changes
#   scripts/kernel_ab.sh save older main~2    # main~2's version of every file that differs from it
#   scripts/kernel_ab.sh save try             # the working tree's changed files as they are now (then edit on)
# A version holds the files that differed when it was saved; any other file comes from the tree, so save a
# revision's version after the last edit. Versions live in .carry/ab/NAME (carry .carry). Then on the
# GPU machine:
#   VERSIONS="base try" RUNS="--case softmax_top8 --kernel split;--case deepseek_v3 --kernel split" \
#     scripts/kernel_ab.sh run
# builds bench_router (TARGET) for base, try and the tree itself ("tree", built last and left in place), runs
# each RUNS entry (';'-separated argument lists) of each version ROUNDS times (default 2), and writes $OUT/ab.jsonl
# (every JSON line tagged with "version" and "round") and, in $OUT/summary.txt, each line's times per version
# and their ratio to the first version. TESTS="gtest filter" then runs epx_tests_gpu of the tree;
# MEMCHECK="gtest filter" runs those tests under compute-sanitizer memcheck. CMAKE_ARGS adds configure options
# (default -DEPX_WITH_CUTLASS=OFF: the router, layout and quantization kernels build in a fraction of the time).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/kernel_ab.sh save NAME [REV] | run}

if [ "$mode" = save ]; then
  name=${2:?usage: scripts/kernel_ab.sh save NAME [REV]}
  rev=${3:-}
  [ "$name" != tree ] || { echo "kernel_ab: \"tree\" is the working tree itself" >&2; exit 2; }
  files=$(git diff --name-only "${rev:-HEAD}" -- src include tests bench)
  if [ -z "$files" ]; then
    echo "kernel_ab: the working tree differs from ${rev:-HEAD} in no file under src, include, tests or bench" >&2
    exit 2
  fi
  rm -rf ".carry/ab/$name"
  for f in $files; do
    mkdir -p ".carry/ab/$name/$(dirname "$f")"
    if [ -n "$rev" ]; then
      git show "$rev:$f" >".carry/ab/$name/$f" 2>/dev/null || { echo "kernel_ab: $f is not in $rev" >&2; exit 2; }
    else
      cp "$f" ".carry/ab/$name/$f"
    fi
  done
  from="the tree's"
  [ -z "$rev" ] || from="$rev's"
  echo "kernel_ab: .carry/ab/$name holds $(echo "$files" | wc -w) file(s), $from: $(echo $files)"
  exit 0
fi
[ "$mode" = run ] || { echo "kernel_ab: unknown mode \"$mode\" (save, run)" >&2; exit 2; }

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
B=${BUILD:-build-ab}
TARGET=${TARGET:-bench_router}
ROUNDS=${ROUNDS:-2}
VERSIONS=${VERSIONS:-base}
RUNS=${RUNS:-}
TESTS=${TESTS:-}
MEMCHECK=${MEMCHECK:-}
export NCCL_NVLS_ENABLE=0
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/summary.txt"; }
log "kernel_ab: $(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"
gt=()
[ -d .carry/googletest ] && gt=(-DEPX_GTEST_SOURCE="$PWD/.carry/googletest")
# shellcheck disable=SC2086
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:--DEPX_WITH_CUTLASS=OFF} "${gt[@]}" \
  >"$OUT/cmake.log" 2>&1 || { log "configure failed (cmake.log)"; exit 1; }

# Every file some version replaces, saved as the tree has it, so each build starts from the tree.
files=$(for v in $VERSIONS; do
          [ -d ".carry/ab/$v" ] || { echo "kernel_ab: no .carry/ab/$v (scripts/kernel_ab.sh save $v)" >&2; exit 2; }
          (cd ".carry/ab/$v" && find . -type f | sed 's@^\./@@')
        done | sort -u) || exit 2
keep=$(mktemp -d)
for f in $files; do mkdir -p "$keep/$(dirname "$f")"; cp -p "$f" "$keep/$f"; done
bin_dir=$(mktemp -d)
built=()
for v in $VERSIONS tree; do
  for f in $files; do cp "$keep/$f" "$f"; done
  if [ "$v" != tree ]; then
    (cd ".carry/ab/$v" && find . -type f | sed 's@^\./@@') | while read -r f; do cp ".carry/ab/$v/$f" "$f"; done
  fi
  if ninja -C "$B" -j"${JOBS:-16}" "$TARGET" >"$OUT/build_$v.log" 2>&1; then
    cp "$(find "$B" -name "$TARGET" -type f -perm -u+x | head -1)" "$bin_dir/$v"
    built+=("$v")
    log "$v built"
  else
    log "$v: build failed (build_$v.log)"
    grep -E "error" -A4 "$OUT/build_$v.log" | head -20
  fi
done
for f in $files; do cp -p "$keep/$f" "$f"; done  # the tree as it came (its own times: the tree build is current)

n=${#built[@]}
for r in $(seq 1 "$ROUNDS"); do
  for i in $(seq 0 $((n - 1))); do
    v=${built[$(((i + r - 1) % n))]}
    echo "$RUNS" | tr ';' '\n' | while read -r args; do
      # shellcheck disable=SC2086
      "$bin_dir/$v" $args 2>>"$OUT/bench.err" | sed -n "s/^{/{\"version\":\"$v\",\"round\":$r,/p" >>"$OUT/ab.jsonl"
    done
  done
done
log "benchmarks done: ${built[*]}, $ROUNDS round(s)"
python3 - "$OUT/ab.jsonl" "${built[@]}" <<'PY' | tee -a "$OUT/summary.txt"
import collections, json, sys
versions = sys.argv[2:]
times = collections.defaultdict(lambda: collections.defaultdict(list))
skip = {"version", "round", "us", "us_stream", "gbps", "hbm_gbps", "hbm_fraction", "meets_target", "bytes"}
for line in open(sys.argv[1]):
    try:
        j = json.loads(line)
    except ValueError:
        continue
    t = j.get("us", j.get("time_us"))
    if t is None:
        continue
    key = " ".join(f"{k}={v}" for k, v in j.items() if k not in skip and k not in ("bench", "device", "sms"))
    times[key][j["version"]].append(round(float(t), 2))
for key, by in times.items():
    first = by.get(versions[0])
    parts = []
    for v in versions:
        ts = by.get(v, [])
        ratio = (sum(ts) / len(ts)) / (sum(first) / len(first)) if ts and first else float("nan")
        parts.append(f"{v} {ts} {ratio:.3f}")
    print(key, "|", " | ".join(parts))
PY
if [ -n "$TESTS" ]; then
  ninja -C "$B" -j"${JOBS:-16}" epx_tests_gpu >"$OUT/build_tests.log" 2>&1 || log "epx_tests_gpu: build failed"
  timeout "${TEST_TIMEOUT:-420}" "$B/tests/epx_tests_gpu" --gtest_filter="$TESTS" >"$OUT/tests.log" 2>&1
  log "tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure" -A6 "$OUT/tests.log" | head -40
fi
if [ -n "$MEMCHECK" ]; then
  timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool memcheck "$B/tests/epx_tests_gpu" \
    --gtest_filter="$MEMCHECK" >"$OUT/memcheck.log" 2>&1
  log "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
rm -rf "$keep" "$bin_dir"
