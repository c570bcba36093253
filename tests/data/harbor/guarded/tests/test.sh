#!/usr/bin/env bash
# Harbor style: pytest run from the working directory (/app), the reward from its exit status.
mkdir -p /logs/verifier
if python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
