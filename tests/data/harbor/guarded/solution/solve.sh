#!/usr/bin/env bash
set -euo pipefail
python3 -c "print(sum(int(x) for x in open('numbers.txt').read().split()))" > answer.txt
