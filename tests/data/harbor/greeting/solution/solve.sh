#!/usr/bin/env bash
# Harbor's oracle: run in the task's image, from its WORKDIR.
set -euo pipefail
greet world > out.txt
