#!/usr/bin/env bash
# The GPU check on a GPU machine without a package registry (one H200, Python 3.12, torch 2.11;
# see docs/gpu_check.md): the one command a remote run there issues, from the repository root,
# with .device-bundle carried:
#
#     bash scripts/device/gpu_check.sh [gpu_check.py flags, e.g. --stages learner,rollout]
#
# Unpacks the bundle (ray, pyzmq, msgspec for Python 3.12) into a site folder, puts it and the
# working tree on PYTHONPATH, and runs scripts/gpu_check.py on CUDA with the report in $OUT
# (gpu_check.json, gpu_check.log) and the scratch files in /tmp. BUDGET_S (default 520) is
# every stage's time together; unpacking takes about 20 s more. Needs nothing from outside.
# PYTHON, DEVICE (cpu: a rehearsal, docs/gpu_check.md), SITE and WORK override the
# interpreter, the device, the site folder and the scratch folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?OUT must name the folder the report goes to (the remote run sets it)}"
PYTHON="${PYTHON:-python3}"
site=$("$PYTHON" scripts/device/unpack.py .device-bundle --to "${SITE:-/tmp/fleetrl-site}")
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing outside the machine can be reached
exec "$PYTHON" scripts/gpu_check.py --device "${DEVICE:-cuda}" --out "$OUT" \
    --work "${WORK:-/tmp/gpu_check_work}" --budget-s "${BUDGET_S:-520}" "$@"
