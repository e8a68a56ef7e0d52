#!/usr/bin/env bash
# Forwarder kept for the command the team brief and the GPU check's request name; the GPU check is gpu_check/run.sh
# (docs/gpu.md).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../gpu_check/run.sh" "$@"
