#!/usr/bin/env bash
# The outer loop's checks on a machine with a CUDA GPU, through the Python API
# (bench/outer_api_124m.py), from the repository root:
#
#     bench/gpu_outer.sh check OUTDIR   # two workers, bfloat16 GPT-2 on the GPU, 2 rounds:
#                                       # one final root, the loss falls, verify passes
#     bench/gpu_outer.sh table OUTDIR   # the 124M table: 3 workers + a joiner at round 2, 4 rounds,
#                                       # ~60 s of compute a round, on the three-continent
#                                       # testbed where this machine can make it
#
# Each writes OUTDIR/<stage>.log and OUTDIR/<stage>.json and exits with the bench's status.
# Every run is bounded (CHECK_LIMIT, TABLE_LIMIT seconds). The CPU runs the same code in
# tests/training/test_outer_api*.py; this is what only a GPU can show.
set -u -o pipefail
stage=${1:?usage: bench/gpu_outer.sh check|table OUTDIR}
out=${2:?usage: bench/gpu_outer.sh check|table OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
CHECK_LIMIT=${CHECK_LIMIT:-240}
TABLE_LIMIT=${TABLE_LIMIT:-540}
python=${PYTHON:-python3}

case $stage in
check)
    timeout "$CHECK_LIMIT" "$python" bench/outer_api_124m.py --size tiny --workers 2 \
        --no-joiner --rounds 2 --device cuda --dtype bfloat16 --lr 1e-3 \
        --compute-seconds 5 --check --json-out "$out/check.json" 2>&1 | tee "$out/check.log"
    ;;
table)
    wan=--wan
    if ! "$python" -c 'from bench.wan.testbed import unavailable_reason as u; r = u(); print(r or "WAN testbed: available"); raise SystemExit(r is not None)'; then
        wan=
        echo "running on 127.0.0.1 instead"
    fi
    timeout "$TABLE_LIMIT" "$python" bench/outer_api_124m.py --device cuda --dtype bfloat16 \
        --batch 16 --seq 1024 --compute-seconds "${COMPUTE_SECONDS:-62}" \
        --rounds "${ROUNDS:-4}" --joiner-round 2 $wan --json-out "$out/table.json" 2>&1 |
        tee "$out/table.log"
    ;;
*)
    echo "unknown stage $stage (check or table)" >&2
    exit 2
    ;;
esac
