"""Task images without Docker: what a Dockerfile builds on, substitutes, the build key, the task's limits and
timeouts, the signs of a missing network. (With Docker: tests/rollout/test_harbor_tasks.py.)"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.messages import RolloutRequest
from pipeline.rollout.sandbox.base import harness_limit
from pipeline.rollout.sandbox.container import task_limits
from pipeline.rollout.sandbox.dockerfile import DockerfileError, base_images, instructions, substitute
from pipeline.rollout.sandbox.task_images import context_key, network_failure, write_context
from pipeline.rollout.tasks import AgentSection, EnvironmentSection, Task, TaskConfig


def images(text: str, **build_args: str) -> list[tuple[str, int, str]]:
    return [(r.image, r.line, r.kind) for r in base_images(text, build_args)]


# ------------------------------------------------------------------------------------------- Dockerfiles
def test_from_with_arg_defaults_stages_and_copy_from():
    text = """\
# syntax comment
ARG BASE=debian:bookworm-slim
ARG TAG
FROM ${BASE} AS build
RUN make \\
    all
FROM --platform=linux/amd64 python:3.11-${TAG:-slim}
COPY --from=build /out /out
COPY --from=0 /x /x
COPY --from=busybox:1.36 /bin/busybox /bin/busybox
FROM scratch
FROM build
"""
    assert images(text) == [("debian:bookworm-slim", 4, "FROM"), ("python:3.11-slim", 7, "FROM"),
                            ("busybox:1.36", 10, "COPY --from")]
    # a build argument overrides the default; ${X:-d} uses it once set
    assert images(text, BASE="bridle-base", TAG="bookworm")[:2] == [("bridle-base", 4, "FROM"),
                                                                    ("python:3.11-bookworm", 7, "FROM")]


def test_stage_names_are_case_insensitive_and_args_after_from_are_not_global():
    text = "FROM a:1 AS Builder\nARG LATE=zzz\nFROM builder\nFROM b:${LATE:-2}\n"
    assert images(text) == [("a:1", 1, "FROM"), ("b:2", 4, "FROM")]


def test_unusable_dockerfiles_are_refused():
    with pytest.raises(DockerfileError, match="no FROM"):
        base_images("RUN true\n")
    with pytest.raises(DockerfileError, match="names no image"):
        base_images("ARG EMPTY\nFROM ${EMPTY}\n")


def test_continuations_and_comment_lines_inside_them():
    insts = instructions("FROM a\nRUN echo 1 \\\n# inside\n  && echo 2\n\nCMD x\n")
    assert [(i.keyword, i.args, i.first, i.last) for i in insts] == [
        ("FROM", "a", 0, 0), ("RUN", "echo 1 && echo 2", 1, 3), ("CMD", "x", 5, 5)]


def test_substitute_rewrites_only_the_named_instructions():
    text = "ARG B=debian:bookworm-slim\nFROM --platform=x ${B} \\\n  AS base\nRUN true\nCOPY --from=busybox:1 /a /a\n"
    refs = base_images(text)
    out = substitute(text, {refs[0].index: "bridle-rootfs:bookworm", refs[1].index: "local-busybox"})
    assert out == ("ARG B=debian:bookworm-slim\nFROM --platform=x bridle-rootfs:bookworm AS base\nRUN true\n"
                   "COPY --from=local-busybox /a /a\n")
    assert [r.image for r in base_images(out)] == ["bridle-rootfs:bookworm", "local-busybox"]
    assert substitute(text, {}) == text


@given(st.lists(st.sampled_from(["debian:12", "img/a:1", "reg.io/x/y@sha256:" + "a" * 64, "${B}"]), min_size=1,
                max_size=4), st.data())
def test_substituted_images_are_what_is_read_back(froms, data):
    text = "ARG B=argimg:1\n" + "".join(f"FROM {f} AS s{i}\nRUN true \\\n  x\n" for i, f in enumerate(froms))
    refs = base_images(text)
    chosen = data.draw(st.sets(st.sampled_from([r.index for r in refs])))
    out = substitute(text, {i: f"sub{i}:x" for i in chosen})
    want = [f"sub{r.index}:x" if r.index in chosen else r.image for r in refs]
    assert [r.image for r in base_images(out)] == want


# ------------------------------------------------------------------------------------------- build key
def test_context_key_follows_content_mode_links_and_bases(tmp_path):
    env = tmp_path / "environment"
    (env / "app").mkdir(parents=True)
    (env / "Dockerfile").write_text("FROM x\n")
    (env / "app" / "a.txt").write_text("1")
    key = context_key(env, "FROM x\n", ["sha256:1"])
    assert key == context_key(env, "FROM x\n", ["sha256:1"])
    assert key != context_key(env, "FROM y\n", ["sha256:1"])  # the Dockerfile as built (after substitution)
    assert key != context_key(env, "FROM x\n", ["sha256:2"])  # a rebuilt base image
    (env / "Dockerfile").write_text("FROM changed-but-not-built\n")
    assert key == context_key(env, "FROM x\n", ["sha256:1"])  # the task's own file is not what is built
    for change in (lambda: (env / "app" / "a.txt").write_text("2"), lambda: (env / "app" / "a.txt").chmod(0o755),
                   lambda: (env / "app" / "l").symlink_to("a.txt"), lambda: (env / "app" / "d").mkdir()):
        change()
        new = context_key(env, "FROM x\n", ["sha256:1"])
        assert new != key
        key = new


def test_build_context_carries_the_substituted_dockerfile(tmp_path):
    import tarfile

    env = tmp_path / "environment"
    (env / "tools").mkdir(parents=True)
    (env / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (env / "tools" / "t.sh").write_text("#!/bin/sh\n")
    (env / "tools" / "t.sh").chmod(0o750)
    write_context(env, "FROM bridle-rootfs:bookworm\n", tmp_path / "ctx.tar")
    with tarfile.open(tmp_path / "ctx.tar") as tar:
        names = tar.getnames()
        assert tar.extractfile("Dockerfile").read() == b"FROM bridle-rootfs:bookworm\n"
        assert tar.getmember("tools/t.sh").mode == 0o750
    assert sorted(names) == ["Dockerfile", "tools", "tools/t.sh"]
    assert (env / "Dockerfile").read_text() == "FROM debian:bookworm-slim\n"


# ----------------------------------------------------------------------------------- limits, timeouts
def task_with(tmp_path: Path, environment: EnvironmentSection | None = None,
              agent: AgentSection | None = None) -> Task:
    config = TaskConfig(environment=environment or EnvironmentSection(), agent=agent or AgentSection())
    return Task(id="t", path=str(tmp_path), instruction="x", config=config)


def test_limits_come_from_the_task_capped_by_the_settings(tmp_path):
    mib = 1 << 20
    settings = {"cpus": 2.0, "memory": 2048 * mib, "pids": 512}
    unset = task_limits(task_with(tmp_path), **settings)
    assert (unset.cpus, unset.memory, unset.pids, unset.notes) == (2.0, 2048 * mib, 512, ())
    lower = task_limits(task_with(tmp_path, EnvironmentSection(cpus=0.5, memory="384M", pids=64)), **settings)
    assert (lower.cpus, lower.memory, lower.pids, lower.notes) == (0.5, 384 * mib, 64, ())
    old_style = task_limits(task_with(tmp_path, EnvironmentSection(memory_mb=300)), **settings)
    assert old_style.memory == 300 * mib
    higher = task_limits(task_with(tmp_path, EnvironmentSection(cpus=8, memory="16G", pids=10_000)), **settings)
    assert (higher.cpus, higher.memory, higher.pids) == (2.0, 2048 * mib, 512)
    assert higher.notes == ("task asks cpus = 8; capped at [sandbox.docker] cpus = 2",
                            "task asks memory = 16G; capped at [sandbox.docker] memory = 2048m",
                            "task asks pids = 10000; capped at [sandbox.docker] pids = 512")
    with pytest.raises(ValueError, match=r"\[environment\] memory"):
        task_limits(task_with(tmp_path, EnvironmentSection(memory="lots")), **settings)


def test_harness_limit_is_the_shorter_of_request_and_task(tmp_path):
    def req(timeout_s: float) -> RolloutRequest:
        return RolloutRequest(rollout_id="r", group_id="g", index=0, group_size=1, task_id="t", harness="oracle",
                              token="x", policy_version=0, timeout_s=timeout_s)

    assert harness_limit(req(300), task_with(tmp_path)) == 300
    assert harness_limit(req(300), task_with(tmp_path, agent=AgentSection(timeout_sec=20))) == 20
    assert harness_limit(req(10), task_with(tmp_path, agent=AgentSection(timeout_sec=20))) == 10


def test_task_toml_round_trip_keeps_unset_limits_unset(tmp_path):
    raw = msgspec.to_builtins(TaskConfig())
    assert "cpus" not in raw.get("environment", {}) and "timeout_sec" not in raw.get("agent", {})


# ------------------------------------------------------------------------------------ missing network
@pytest.mark.parametrize("line", [
    b"W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'x'",
    b"curl: (6) Could not resolve host: astral.sh",
    b"socket.gaierror: [Errno -3] Temporary failure in name resolution",
    b"error: Request failed after 3 retries\n  Caused by: dns error: failed to lookup address information",
    b"WARNING: Retrying ... Failed to establish a new connection: [Errno 101] Network is unreachable",
    b"wget: unable to resolve host address 'example.com'",
])
def test_network_failures_are_recognised(line):
    assert network_failure(b"step 1\n" + line + b"\nexit 1\n")


def test_ordinary_failures_are_not_network_failures():
    assert not network_failure(b"FAILED tests/test_outputs.py::test_x - AssertionError: assert 1 == 2\n")
    assert not network_failure(b"")


# ---------------------------------------------------------------------------------------------- payloads
def test_every_harness_payload_holds_what_its_launch_runs():
    """Laid over a task's image, a harness runs from its payload: the executable and the Node it runs on must lie
    inside what the payload copies out of its image."""
    from pipeline.rollout.harnesses import HARNESSES

    for h in HARNESSES.values():
        inside = [p for p in (h.container_binary, h.container_node) if p]
        for path in inside:
            assert any(path == root or path.startswith(root.rstrip("/") + "/") for root in h.payload), (h.name, path)
        assert all(p.startswith("/") and ".." not in p for p in h.payload), h.name
        assert bool(h.payload) == h.uses_proxy, h.name  # only the oracle brings nothing (it runs solve.sh)
