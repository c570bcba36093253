"""What a run left on this host outside its run folder, found the way a restart of the run finds it (by its tag)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline.core.runfiles import marked_pids, run_tag
from pipeline.rollout.sandbox.local import MARKER_RUN
from pipeline.rollout.sandbox.util import run_prefix
from pipeline.training.ranks import RANKS_MARKER
from tests.helpers.docker import containers_of, docker_available


def leftovers_of(run_dir: Path) -> dict[str, list]:
    """Workspaces and proxy-socket folders in the temp dir, sandbox processes and learner ranks (by their environment
    markers), containers (by label), engine port folders in the run folder; only the kinds with something left."""
    tag = run_tag(run_dir)
    tmp = Path(tempfile.gettempdir())
    found: dict[str, list] = {
        "workspaces": sorted(tmp.glob(f"{run_prefix(tag)}*")),
        "proxy_sockets": sorted(tmp.glob(f"bridle.sock-{tag}_*")),
        "processes": marked_pids(f"{MARKER_RUN}={tag}".encode()),
        "learner_ranks": marked_pids(f"{RANKS_MARKER}={tag}".encode()),
        "containers": containers_of(tag) if docker_available() else [],
        "engine_ports": sorted([*run_dir.glob("*.port"), *run_dir.glob("bridle-engine-port-*")]),
    }
    return {k: v for k, v in found.items() if v}
