"""Every message that crosses an actor boundary: the map of the system.

Read top to bottom, this file follows one rollout through the graph (docs/architecture.md):

    Scheduler --RolloutRequest--> Proxy (learns the token) --RolloutRequest, ServiceReady--> SandboxPool
    SandboxPool --(harness speaks HTTP)--> Proxy --CallStarted/ModelCall/CallFailed--> Collector
    Collector <--RolloutFinished-- SandboxPool
    Collector --SettledRollout--> TreeBuilder (and Proxy, which forgets the token) --TreeGroup--> Learner
    Learner --PolicyUpdated--> Proxy (loads the weights into the engine), Scheduler
    Proxy --EngineReady--> Learner (weight sync without the disk: the learner pushes each update to the workers)
    anyone --Metric--> Monitor;  ConfigWatcher --ConfigChanged--> (every actor, through the supervisor)

Token ids and log-probabilities travel as raw little-endian arrays in ``bytes`` fields (``I32``/``F32``), not as
lists of Python ints: a ModelCall with 8k input ids encodes to ~32 KB in microseconds, and ``ids(msg.input_ids)``
is a zero-copy numpy view. Use :func:`pack_i32` / :func:`pack_f32` to build them; code that fills such an array
itself uses :data:`I32_DTYPE` / :data:`F32_DTYPE`.

Adding a field: give it a default so that older event logs still decode, and bump SCHEMA_VERSION only when an old
log can no longer be read correctly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np

SCHEMA_VERSION = 2  # 2: demonstration packs typed (purpose, packs), TreeGroup.temperature

I32 = Annotated[bytes, msgspec.Meta(description="int32 little-endian array; read with ids()")]
F32 = Annotated[bytes, msgspec.Meta(description="float32 little-endian array; read with floats()")]
U8 = Annotated[bytes, msgspec.Meta(description="uint8 array (0/1 masks); read with mask()")]

# The dtypes of I32 / F32 fields (and of PackedTree's arrays): the one definition of the wire format.
I32_DTYPE = np.dtype("<i4")
F32_DTYPE = np.dtype("<f4")


def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=I32_DTYPE).tobytes()


def pack_f32(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=F32_DTYPE).tobytes()


def pack_u8(values: Sequence[bool] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=np.uint8).tobytes()


def ids(buf: bytes) -> np.ndarray:
    """Read-only int32 view of an I32 field."""
    return np.frombuffer(buf, dtype=I32_DTYPE)


def floats(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=F32_DTYPE)


def mask(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8).astype(bool)


class _Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of all messages. ``type`` (the class name) is the tag in msgpack and JSON."""


# --------------------------------------------------------------------------------------------- scheduling
class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Policy sampling for one rollout; the proxy applies it to every call the harness makes."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    seed: int | None = None


class EvalTag(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What an evaluation rollout measures, so an evaluation can be recomputed from the event log alone."""

    step: int = -1  # the RL step whose policy is evaluated (-1: a standalone evaluation, run.py --eval)
    column: Literal["in-space", "held-out", "out-of-space", "custom"] = "custom"
    family: str = ""  # the task's family (task.toml [metadata] family)
    oracle_steps: int = 0  # the task's reference solution in calls, for step efficiency (0: none)


class ProxyEndpoint(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where a rollout's harness reaches the proxy worker that owns it ([proxy] workers > 1)."""

    worker: int
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    unix_socket: str = ""


TOKEN_PREFIX = "bridle-"


def sampling_seed(seed: int, rollout_id: str) -> int:
    """A rollout's sampling seed (31 bits, as engines take it): the run's seed and the rollout's id, hashed, so two
    runs with one seed sample alike and every rollout of a group samples differently. The proxy adds each call's
    sequence number."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/{rollout_id}".encode()).digest()[:4], "little") >> 1


def rollout_token() -> str:
    """A rollout's secret for the proxy: 192 random bits (``secrets``), URL-safe, named as bridle's."""
    import secrets

    return TOKEN_PREFIX + secrets.token_urlsafe(24)


class RolloutRequest(_Msg, kw_only=True):
    """Scheduler -> SandboxPool (and Proxy, which learns the token from it). One rollout of one group."""

    rollout_id: str
    group_id: str  # one (task, harness) pair x G rollouts
    index: int  # position inside the group, 0..group_size-1
    group_size: int
    task_id: str
    harness: str  # adapter name, e.g. "whitebox:S0T1O2C1W0", "claude-code", "codex"
    token: str  # per-rollout secret the harness presents to the proxy
    policy_version: int  # version when issued; staleness is measured against it
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    timeout_s: float = 600.0
    purpose: Literal["train", "eval", "sft"] = "train"
    task_path: str = ""  # the task folder (Harbor format) the sandbox lays out and verifies
    # Scripted rollouts (oracle demonstrations for cold-start SFT, tests): the responses the proxy's scripted engine
    # plays for this rollout, in pipeline.serving.scripted's neutral form. Empty: the policy engine answers.
    script: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # purpose "sft": how many demonstration rollouts the cold start issues in all, so the tree builder knows when
    # its last (possibly partial) pack is complete and how many packs the learner must wait for.
    demonstrations: int = 0
    eval: EvalTag | None = None  # purpose "eval": what the rollout measures
    # Set by the proxy when it runs several workers: the one that owns this rollout, where the sandbox pool sends
    # the harness (instead of ServiceReady's address).
    proxy: ProxyEndpoint | None = None
    # Dynamic sampling ([run].dynamic_sampling): how many groups without a reward spread this group replaces in its
    # slot of the step (0: the slot's first group).
    resample: int = 0


# ---------------------------------------------------------------------------------------------- the proxy
class ServiceReady(_Msg, kw_only=True):
    """Proxy -> SandboxPool: where harnesses reach the policy. Sent once, before any RolloutRequest is forwarded."""

    service: str
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    unix_socket: str = ""  # the same server on a Unix socket, for sandboxes without a network


class EngineReady(_Msg, kw_only=True):
    """Proxy -> Learner: the engine servers serving the policy, once they are up. With ``[learner].weight_sync =
    "distributed"`` the learner makes them join a process group and broadcasts each update to them
    (docs/serving.md, "Weight sync"); empty ``servers``: an engine that takes weights only from disk (scripted)."""

    # each engine server's base URL (behind a router: the servers, not the router); "workers" on the wire
    servers: list[str] = msgspec.field(name="workers")
    weight_version: int = 0


class CallStarted(_Msg, kw_only=True):
    """Proxy -> Collector: a harness request was authenticated and will reach the engine."""

    rollout_id: str
    call_id: str
    seq: int  # arrival order within the rollout
    t: float


class VersionSpan(msgspec.Struct, array_like=True):
    """Output tokens from ``start`` on were sampled by policy ``version`` (a weight update can land mid-call)."""

    start: int
    version: int


class CallTimings(msgspec.Struct, kw_only=True, omit_defaults=True):
    received: float
    engine_start: float = 0.0
    engine_end: float = 0.0
    sent: float = 0.0
    render_s: float = 0.0


class ToolUse(msgspec.Struct, array_like=True):
    """A tool call the policy made, as the proxy parsed it from the output: its name and its arguments, each string
    value cut to :data:`TRACE_ARG_CHARS` characters (enough to name a path or a command; the output ids hold all)."""

    name: str
    args: dict[str, str] = msgspec.field(default_factory=dict)


class ToolOutcome(msgspec.Struct, array_like=True):
    """A tool result the harness sent back, and whether it was a failure (the protocol's flag, else the result's
    text; pipeline.serving.trace)."""

    name: str
    error: bool


TRACE_ARG_CHARS = 300


class CallTrace(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a call did, in the harness's terms, for behavioural metrics (docs/evaluation.md): the tools its request
    offered, the tool results the request carried since the previous assistant turn, and what the output was."""

    offered: list[str] = msgspec.field(default_factory=list)
    outcomes: list[ToolOutcome] = msgspec.field(default_factory=list)
    output: Literal["tool_calls", "answer", "malformed", "empty"] = "empty"
    uses: list[ToolUse] = msgspec.field(default_factory=list)


class ModelCall(_Msg, kw_only=True):
    """Proxy -> Collector: one completed model call, exactly as the policy saw and produced it."""

    rollout_id: str
    call_id: str
    seq: int
    protocol: Literal["chat", "anthropic", "responses", "generate"]
    label: Literal["main", "subagent", "compaction"] = "main"
    input_ids: I32
    output_ids: I32  # includes the stop token the engine matched, if any
    logprobs: F32  # one per output id: log_softmax(logits / T) of the sampled token (pi_rollout)
    versions: list[VersionSpan] = msgspec.field(default_factory=list)
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] = "stop"
    spliced_turns: int = 0  # assistant turns whose original sampled ids were reused (token-in)
    rendered_turns: int = 0  # assistant turns that had to be re-rendered from text
    model: str = ""
    timings: CallTimings | None = None
    trace: CallTrace | None = None  # None in logs recorded before traces existed


class CallFailed(_Msg, kw_only=True):
    """Proxy -> Collector: a call that produced no usable record (engine error, client dropped, aborted)."""

    rollout_id: str
    call_id: str
    seq: int
    reason: str
    t: float


# ----------------------------------------------------------------------------------------- the sandbox
RolloutStatus = Literal["ok", "timeout", "sandbox_error", "harness_error", "verifier_error"]


class RolloutTimings(msgspec.Struct, kw_only=True, omit_defaults=True):
    queued: float = 0.0
    sandbox_ready: float = 0.0
    harness_done: float = 0.0
    verified: float = 0.0


class RolloutFinished(_Msg, kw_only=True):
    """SandboxPool -> Collector: the harness ended and the verifier scored the workspace (or something failed)."""

    rollout_id: str
    group_id: str
    status: RolloutStatus
    reward: float = 0.0
    rewards: dict[str, float] = msgspec.field(default_factory=dict)  # named parts, e.g. rule / judge
    exit_code: int | None = None
    details: str = ""  # bridle's verdict summary or error text (a harness failure: also the harness's output tail)
    timings: RolloutTimings = msgspec.field(default_factory=RolloutTimings)


# ------------------------------------------------------------------------------------------ collection
class SettledRollout(_Msg, kw_only=True):
    """Collector -> TreeBuilder: every call of a rollout, once nothing more can arrive."""

    request: RolloutRequest
    finished: RolloutFinished
    calls: list[ModelCall]
    failed_calls: list[CallFailed] = msgspec.field(default_factory=list)
    settle: Literal["quiet", "timeout"] = "quiet"  # timeout: stragglers were aborted
    aborted_calls: int = 0


# ------------------------------------------------------------------------------------------------ trees
class PackedTree(msgspec.Struct, kw_only=True):
    """A group's kept tree nodes laid out depth-first as one sequence (docs/trees.md, "The packed layout").

    For each token i: ``positions[i]`` is its depth in its root-to-leaf path (the RoPE position);
    token j is visible to token i iff ``j <= i < subtree_end[j]``; ``pred[i]`` is the index whose logits predict
    token i (i-1 inside a node, the parent's last token for a node's first token, -1 for a root's first token).
    ``rollout[i]`` is the rollout index inside the group (-1 for prefixes shared by several rollouts), which is
    also the advantage slot; ``segment[i]`` numbers the rollout's segments (compaction restarts).
    """

    tokens: I32
    positions: I32
    subtree_end: I32
    pred: I32
    trainable: U8
    logprobs: F32  # pi_rollout for trainable tokens, 0 elsewhere
    rollout: I32
    segment: I32


class TreeStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    calls: int = 0
    leaves: int = 0
    kept_leaves: int = 0
    segments: int = 0
    depth: int = 0
    tokens_total: int = 0  # tokens of all calls as the harness sent them (input + output, summed over calls)
    tokens_packed: int = 0  # tokens actually stored (shared prefixes once)
    tokens_trainable: int = 0
    tokens_output: int = 0  # output tokens of all calls (what could have been trained)
    # Share of the calls after the first that attach at an exact prefix: their input extends an earlier call's
    # whole history, or is an earlier call's input (a retry). A rollout of new roots reads 0 %.
    exact_prefix_attach_rate: float = 0.0
    attach: dict[str, int] = msgspec.field(default_factory=dict)  # how each call joined: first, exact, rewrite:*, ...
    calls_by_fate: dict[str, int] = msgspec.field(default_factory=dict)  # trained, auxiliary, not_trained
    # Main-agent segments beyond the first that do not start from the output of a compaction made just before
    # them: calls the builder could not join (still trained, as segments of their own).
    unjoined_segments: int = 0
    # Compaction calls (labelled, or found from structure) whose output no next segment starts from: the label is
    # not confirmed (still not trained: the request asked for a summary).
    unconfirmed_compactions: int = 0
    dropped: dict[str, int] = msgspec.field(default_factory=dict)  # reason -> count


class RolloutSummary(msgspec.Struct, kw_only=True, omit_defaults=True):
    rollout_id: str
    reward: float
    status: RolloutStatus
    stats: TreeStats = msgspec.field(default_factory=TreeStats)
    policy_version: int = 0  # oldest version that produced any of its trainable tokens


class LeftOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A rollout of a group that is not trained, and why, in bridle's own terms: its status, the harness's exit
    code and the tree builder's reason. Never ``RolloutFinished.details``, which may end with what the harness
    printed: the learner quotes these in its warnings (docs/learner.md, "When a step cannot learn")."""

    rollout_id: str
    status: RolloutStatus
    # the tree builder's: "status harness_error", "no usable calls", "over_branching (...)", "no trainable tokens
    # kept"; for a rollout that was usable in a group too small to train: "group dropped"
    reason: str = ""
    exit_code: int | None = None


class TreeGroup(_Msg, kw_only=True):
    """TreeBuilder -> Learner: one (task, harness) group, ready to train."""

    group_id: str
    task_id: str
    harness: str
    rollouts: list[RolloutSummary]
    packed: PackedTree
    issued_version: int = 0
    purpose: Literal["train", "eval", "sft"] = "train"
    packs: int = 0  # purpose "sft": demonstration packs of the whole cold start (this is one of them)
    # The sampling temperature of its rollouts: pi_rollout's logprobs are log_softmax(logits / T), so the learner
    # scores the same distribution (a hot-reloaded [scheduler].temperature reaches the learner with the data).
    temperature: float = 1.0
    # The group's rollouts that are not in ``rollouts`` (a failed status, an unusable tree), so the learner can
    # count every rollout of a step by status. Empty in logs recorded before it existed.
    left_out: list[LeftOut] = msgspec.field(default_factory=list)
    resample: int = 0  # as its rollouts' RolloutRequest.resample


class GroupDropped(_Msg, kw_only=True):
    """TreeBuilder -> Learner: a group that will not be trained, and why. It still counts towards its step (or,
    for a demonstration pack, towards the cold start), so a drop never stalls the run."""

    group_id: str
    reason: str
    valid_rollouts: int = 0
    purpose: Literal["train", "eval", "sft"] = "train"
    packs: int = 0  # purpose "sft": as TreeGroup.packs
    # Training groups: which task and harness, and every rollout of the group (none is trained) with its status.
    # Empty in logs recorded before they existed.
    task_id: str = ""
    harness: str = ""
    left_out: list[LeftOut] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------------------------------------- learner
class PolicyUpdated(_Msg, kw_only=True):
    """Learner -> Proxy (which loads ``weights_path`` into the engine), Scheduler (staleness accounting).

    ``pushed``: the learner already loaded this version into every engine server over the weight update group
    (``weights_path`` is then empty: nothing was written). Neither a path nor ``pushed``: the policy is unchanged
    (a step that trained nothing)."""

    version: int
    step: int
    weights_path: str = ""
    pushed: bool = False
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    batch_hash: str = ""  # sha256 of the packed batch this update trained on (replay reproduces it)
    groups: list[str] = msgspec.field(default_factory=list)  # ids of the TreeGroups it trained on, in order


class GroupResample(_Msg, kw_only=True):
    """Learner -> Scheduler, with ``[run].dynamic_sampling`` (DAPO's dynamic sampling): the training group
    ``group_id`` had no reward spread and was not trained; issue group number ``resample`` of its slot in its place
    (another task, the same harness). The learner asks only while ``resample <= dynamic_sampling``, and counts the
    step's groups without the replaced ones, so each step still trains ``groups_per_step`` groups."""

    group_id: str
    resample: int


# -------------------------------------------------------------------------------------- control, metrics
class ConfigChanged(_Msg, kw_only=True):
    """ConfigWatcher -> an actor (through the supervisor): a validated change of one config section."""

    section: str
    changes: dict[str, Any]  # field -> new value
    accepted: bool = True
    reason: str = ""  # why it was refused, when accepted is False


# What a Metric measured; readers (the monitor, plots, benchmarks) dispatch on this, never on actor names.
MetricKind = Literal[
    "rl_step",  # learner, one RL update; step = RL steps done: reward, pass_rate, loss, entropy, tokens_per_s, step_s,
    # and whether it could learn: groups, zero_var_frac, rollouts_<status>, ... (docs/learner.md), warnings
    "sft_update",  # learner, one cold-start SFT update: loss, sft_epoch, sft_updates (planned in all), tokens_per_s
    "demonstration",  # sandbox, one scripted demonstration rollout finished: reward, ok, rollouts_running
    "rollout",  # sandbox, one policy rollout finished (train or eval): reward, ok, rollouts_running
    "scheduler",  # scheduler, after issuing: groups_in_flight, policy_version, learner_steps, *_total (the plan)
    "tree",  # tree builder, one group built: tree_* statistics, group_dropped
    "settle",  # collector, one rollout settled: settled, settle_timeouts, late_records, duplicate_records
    "weight_sync",  # proxy (disk) or learner (pushed): the engine holds new weights: weight_update_s, policy_version
    "eval",  # evaluator, one evaluation round; step = the RL step evaluated (-1 standalone): pass@k, behaviour
    "other",  # anything else (toy graphs); the default, so that logs written before kinds existed decode
]


class Metric(_Msg, kw_only=True):
    """anyone -> Monitor: numbers measured at one point of the run; ``kind`` says what they are (MetricKind)."""

    source: str  # the sending actor, for people reading metrics.jsonl; not a contract
    kind: MetricKind = "other"
    step: int = -1
    values: dict[str, float] = msgspec.field(default_factory=dict)
    t: float = 0.0
    # What a person must know about these numbers, one line each in bridle's own words (never text a sandbox
    # wrote): e.g. an RL step that could not learn. The sender logs them; the monitor writes and shows them.
    warnings: list[str] = msgspec.field(default_factory=list)
    # what the numbers are about, when one run has several (the tree builder's group: its harness), so readers can
    # split them (metrics.jsonl keeps it as a field; trackers name the scalars <kind>/<harness>/<value>)
    harness: str = ""


class ActorStopped(_Msg, kw_only=True):
    """Supervisor: an actor ended; ``error`` is set when it crashed (and the graph was stopped because of it)."""

    actor: str
    reason: Literal["done", "cancelled", "crashed"]
    error: str = ""


class Note(_Msg, kw_only=True):
    """Free-form payload, for toy graphs in tests and demos."""

    value: Any = None
    seq: int = 0


Message = Union[  # noqa: UP007 — one type per line reads as the list of every message
    RolloutRequest,
    ServiceReady,
    EngineReady,
    CallStarted,
    ModelCall,
    CallFailed,
    RolloutFinished,
    SettledRollout,
    TreeGroup,
    GroupDropped,
    PolicyUpdated,
    GroupResample,
    ConfigChanged,
    Metric,
    ActorStopped,
    Note,
]

MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]


def packed_hash(groups: Sequence[TreeGroup]) -> str:
    """Identity of a training batch: every group's id and packed arrays, in order."""
    import hashlib

    h = hashlib.sha256()
    for g in groups:
        h.update(g.group_id.encode())
        h.update(msgspec.msgpack.encode(g.packed))
    return h.hexdigest()


class Event(msgspec.Struct, array_like=True):
    """One frame of the event log: when, which actor output sent it, and the message."""

    t: float
    src: str  # "actor.output", or "supervisor" / "config"
    msg: Message
