"""Sandbox backends: run one rollout's harness over a fresh workspace, verify it, tear everything down.

Per rollout a backend lays out the task's starting workspace, starts the harness (its adapter in
``pipeline/rollout/harnesses.py`` says how) with the instruction, the proxy address and the rollout token, enforces
``RolloutRequest.timeout_s``, then runs the task's verifier over the workspace and returns a
:class:`~pipeline.messages.RolloutFinished`. Which status a rollout gets (ok, timeout, harness_error,
sandbox_error, verifier_error) is decided in one place for every backend: the template
:meth:`SandboxBackend.run` in :mod:`~pipeline.rollout.sandbox.base`, whose docstring defines the statuses. The
backends implement only its hooks:

- :mod:`~pipeline.rollout.sandbox.local`: the harness as a child process (rlimits, killed as a process group and
  by an environment marker). Convenient and the embedded default, but **no security boundary**.
- :mod:`~pipeline.rollout.sandbox.docker`: one container per rollout from the task's own image
  (:mod:`~pipeline.rollout.sandbox.task_images`: its Dockerfile built offline, the harness's payload mounted
  over it), the task's CPU, memory and pids limits, network ``none``, the proxy through its mounted Unix socket, a
  non-root uid on a read-only root (:mod:`~pipeline.rollout.sandbox.hardening`); the verifier in a fresh container
  from the task's image (:mod:`~pipeline.rollout.sandbox.docker_verify`).

Both can keep sandboxes started ahead (``[sandbox] warm``) and bound how fast sandboxes are created on the host
(:mod:`~pipeline.rollout.sandbox.warm`).
"""

from pipeline.rollout.sandbox.base import CLEANUP_TIMEOUT_S, SandboxBackend, SandboxCommon
from pipeline.rollout.sandbox.docker import CONTAINER_SOCKET, LABEL, DockerBackend, DockerSettings
from pipeline.rollout.sandbox.local import MARKER_ID, MARKER_RUN, LocalBackend, LocalSettings, kill_marked
from pipeline.rollout.sandbox.util import TAIL_CHARS

__all__ = [
    "CLEANUP_TIMEOUT_S",
    "CONTAINER_SOCKET",
    "LABEL",
    "MARKER_ID",
    "MARKER_RUN",
    "TAIL_CHARS",
    "DockerBackend",
    "DockerSettings",
    "LocalBackend",
    "LocalSettings",
    "SandboxBackend",
    "SandboxCommon",
    "kill_marked",
]
