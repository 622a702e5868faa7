#!/usr/bin/env bash
# The GPU check of the CUDA path on a GPU machine without network: the machine's own torch
# with CUDA (and transformers, for the parity tests and the baselines), this repo, and the
# wheels it lacks from .whl/ (`make gpu-wheels` here, where the package index is reachable).
#
#   make gpu-wheels                                   # here: fills .whl/
#   PY=python3 bash benchmarks/gpu_check.sh           # there: ~7.5 min, one H100/H200
#   PY=python3 BUDGET_S=200 ONLY=tests bash benchmarks/gpu_check.sh
#   DRY=1 bash benchmarks/gpu_check.sh                # here: the same commands at toy sizes
#
# The wheels install into a private directory on PYTHONPATH (nothing of the machine's own
# Python changes); benchmarks/gpu_check.py then runs the stages by priority within BUDGET_S
# seconds and writes $OUT/summary.json (after every stage) and $OUT/logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
[[ -x .venv/bin/python && -n "${DRY:-}" && "$PY" == python3 ]] && PY=.venv/bin/python
export OUT=${OUT:-gpu-check}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ -z "${DRY:-}" ]] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${TMPDIR:-/tmp}/pipeserve-gpu-site
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 \
        | tail -3
    export PYTHONPATH=$PYTHONPATH:$SITE
fi
exec $PY benchmarks/gpu_check.py
