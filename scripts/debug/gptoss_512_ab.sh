#!/usr/bin/env bash
# Debug (issue 13, twentieth session): gpt-oss-120b T = 512 runs the 256 entry's 16-row tiles (the
# nearest bucket; 16 rows an expert). The serving-bucket tune (serving_buckets_tune.sh) found
# 32-row tiles 19% faster on the full batch whose one-row padded step was 8.7% slower, and kept the
# old tiles by the strict padded-step rule; the rule now trades (PADDED_TRADE). A/B the winner in
# the whole layer: full batch, 8-row and 1-row padded steps.
# The same for a second candidate table (the winner with one_launch on), when given.
#   OUT=/tmp/x bash scripts/debug/gptoss_512_ab.sh CANDIDATE_TABLE.json [SECOND_TABLE.json]
source "$(dirname "$0")/device_table.sh"
for other in "$@"; do for t in 512 512:8 512:1; do
  timeout 60 python scripts/debug/ab_entry.py gptoss $t 512 "$other" --rounds 3 2>&1 | grep -v -i warn | tail -1
done; done
date -u
