#!/usr/bin/env bash
# Forwarder: the GPU check lives in gpu_check/ (bash gpu_check/run.sh; docs/gpu.md). This path stays because the team brief and issue 20 name `bash benchmarks/gpu_check.sh`.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../gpu_check/run.sh" "$@"
