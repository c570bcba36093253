#!/usr/bin/env bash
# Scores 1 when out.txt holds what this image's `greet world` prints (its tool, ENV and /etc file), from the
# task's WORKDIR; else 0.
set -u
mkdir -p /logs/verifier
expected="$(greet world)"
if [ "$PWD" = /srv/project ] && [ -f out.txt ] && [ "$(cat out.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
