#!/usr/bin/env bash
# Make a Docker engine available and build bridle's sandbox images. Idempotent: each step is skipped when done.
# Needs root (apt-get, dockerd, debootstrap). Run from the repository root with the project's Python active and,
# for the harness images, BRIDLE_HARNESS_BIN pointing at an npm node_modules/.bin that holds the harnesses and the
# private Node (.ci/run installs them); without it they are installed with npm under ~/.cache/bridle/images.
# tmux: the test of the live display runs a short quickstart in a real terminal (tests/e2e/test_terminal.py).
# chromium: the trajectory viewer is tested in a real headless browser (tests/e2e/test_viewer_browser.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v tmux >/dev/null \
    || ! command -v chromium >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io debootstrap tmux chromium >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd >/tmp/bridle-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /tmp/bridle-dockerd.log" >&2; tail -20 /tmp/bridle-dockerd.log >&2; exit 1; }
fi

# BRIDLE_CI_ENGINE_ONLY=1: the engine alone (.ci/run starts it while the virtual environment installs)
[ "${BRIDLE_CI_ENGINE_ONLY:-}" = 1 ] && exit 0

"$PY" -m pipeline.rollout.images
