#!/usr/bin/env bash
# Starts N copies of a command, one per GPU, the way a job launcher would: RANK, WORLD_SIZE,
# LOCAL_RANK and a fresh EPX_NCCL_ID_FILE for the NCCL bootstrap. Exits 77 (skip) when fewer than
# N GPUs are visible, else with the worst exit code of the ranks.
# usage: scripts/run_ranks.sh N command [args...]
set -u
n=$1; shift
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -lt "$n" ]; then
  echo "run_ranks: needs $n GPUs, $gpus visible: skipped"
  exit 77
fi
id_file=$(mktemp -u /tmp/epx_nccl_id.XXXXXX)
export WORLD_SIZE=$n EPX_NCCL_ID_FILE=$id_file NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
pids=()
# A launcher that is stopped (timeout, Ctrl-C) stops its ranks too.
trap 'kill "${pids[@]}" 2>/dev/null; rm -f "$id_file" "$id_file".*; exit 143' TERM INT
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r "$@" > >(sed "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p" || { s=$?; [ $s -gt $rc ] && rc=$s; }
done
rm -f "$id_file" "$id_file".*
exit $rc
