#!/usr/bin/env bash
# bench/gpu_suite.py on the GPU machine (device tool: `bash bench/run_gpu_suite.sh`): one JSON line
# per case on stdout and in $OUT/gpu_suite.jsonl, each SFT case's profile in $OUT/profile.txt;
# about 5-7 minutes, at most --budget-s (420 s) before the last case starts. Extra arguments go to
# the script (e.g. --cases sft_qwen3_moe).
PYTHONPATH=lib PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --out "${OUT:-.}/gpu_suite.jsonl" \
    --profile "${OUT:-.}/profile.txt" "$@"
