#!/bin/bash
# Reward 1 when /app/answer.txt holds the line count of /app/notes.txt, else 0 (Harbor reads
# /logs/verifier/reward.txt). Harbor copies this file to /tests/test.sh and runs it from the workdir.
expected=$(wc -l < /app/notes.txt)
if [ -f /app/answer.txt ] && [ "$(tr -d '[:space:]' < /app/answer.txt)" = "$expected" ]; then
  echo "answer.txt holds $expected: pass"
  echo 1 > /logs/verifier/reward.txt
else
  echo "answer.txt missing or not $expected: fail"
  echo 0 > /logs/verifier/reward.txt
fi
