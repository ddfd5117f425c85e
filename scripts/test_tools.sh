#!/usr/bin/env bash
# The real tools the cluster tests drive (Slurm and munge for the sbatch file, buildah and
# mmdebstrap for the image): each one present, installed with apt-get, or skipped, one line
# each. Usage: scripts/test_tools.sh PACKAGE:COMMAND [PACKAGE:COMMAND ...]
# A skipped tool's tests skip with a line of their own; this script never fails the run.
set -uo pipefail
updated=0
for spec in "$@"; do
  package=${spec%%:*}
  command=${spec#*:}
  if command -v "$command" >/dev/null 2>&1; then
    echo "tools: $package present ($command)"
    continue
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "tools: $package missing and not installable here (needs root and apt-get): its tests skip"
    continue
  fi
  if [ "$updated" = 0 ]; then
    apt-get update -qq >/dev/null 2>&1
    updated=1
  fi
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null 2>&1 &&
     command -v "$command" >/dev/null 2>&1; then
    echo "tools: $package installed with apt-get"
  else
    echo "tools: $package could not be installed with apt-get: its tests skip"
  fi
done
exit 0
