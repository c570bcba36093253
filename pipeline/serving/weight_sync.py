"""Weight sync without the disk: the torch.distributed side of SGLang's ``/init_weights_update_group`` and
``/update_weights_from_distributed`` (docs/serving.md, "Weight sync").

The learner is rank 0 of a process group whose other ranks are the engine servers (worker ``i`` is rank ``1 + i``,
its ``rank_offset``; one rank per worker, so SGLang servers with ``tp_size`` 1). An update is a broadcast from
rank 0 of each tensor, in the order of the ``names`` the servers were sent, while every server receives into
tensors of the announced dtypes and shapes. The embedded engine uses the same functions for its side, so the
path is exercised for real on a CPU (``gloo``); against SGLang on GPUs the backend is ``nccl``.

:func:`open_group` makes the calls SGLang's ``init_custom_process_group`` makes (a TCP rendezvous whose store
rank 0 hosts, a store prefixed with the group's name, a group that is not the process's default one), so both
ends agree on the rendezvous keys, and a learner that already has a default group (several ranks) keeps it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.serving.engine import EngineError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

GROUP_NAME = "weight_update_group"  # SGLang's default group name


class WeightSyncError(EngineError):
    """The process group could not be set up, or a broadcast failed: the caller falls back to the disk path."""


def default_backend(tensors: Mapping[str, torch.Tensor]) -> str:
    """``nccl`` when the weights sit on a GPU (the engine receives on its GPU), else ``gloo``."""
    return "nccl" if any(t.is_cuda for t in tensors.values()) else "gloo"


def open_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, *,
    group_name: str = GROUP_NAME, timeout_s: float = 300.0,
) -> ProcessGroup:
    """Join the update group as ``rank`` (blocks until all ``world_size`` ranks have joined, or ``timeout_s``).

    ``timeout_s`` also bounds every later broadcast in the group: a peer that never takes part fails it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
            group_name=group_name, timeout=timeout,
        )
    except (RuntimeError, ValueError, OSError, dist.DistError) as e:
        raise WeightSyncError(f"cannot join the weight update group {group_name!r} at "
                              f"{master_address}:{master_port} as rank {rank} of {world_size} ({backend}): "
                              f"{type(e).__name__}: {e}") from None
    # group ranks are the global ranks this group's broadcasts name (src=0 is the learner)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_group(group: ProcessGroup) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def manifest(tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes`` (torch names: "bfloat16") and ``shapes`` of an /update_weights_from_distributed body,
    in the order :func:`broadcast` sends the tensors."""
    names = list(tensors)
    return (names, [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            [list(tensors[n].shape) for n in names])


def broadcast(group: ProcessGroup, tensors: Mapping[str, torch.Tensor]) -> None:
    """Rank 0's side of an update: send every tensor, in order; returns when the last one has gone out."""
    import torch.distributed as dist

    try:
        works = [dist.broadcast(t.detach().contiguous(), src=0, group=group, async_op=True)
                 for t in tensors.values()]
        for w in works:
            w.wait()
    except (RuntimeError, dist.DistError) as e:
        raise WeightSyncError(f"broadcasting the weights failed: {type(e).__name__}: {e}") from None


def receive(group: ProcessGroup, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
            device: Any = "cpu") -> dict[str, torch.Tensor]:
    """A worker's side of an update: tensors of the announced dtypes and shapes, filled by rank 0's broadcast."""
    import torch
    import torch.distributed as dist

    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must be as long")
    known = {n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = known.get(dtype)
        if dt is None:
            raise ValueError(f"dtypes: {dtype!r} (for {name}) is not a torch dtype name such as 'bfloat16'")
        out[name] = torch.empty([int(s) for s in shape], dtype=dt, device=device)
    try:
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in out.values()]
        for w in works:
            w.wait()
    except (RuntimeError, dist.DistError) as e:
        raise WeightSyncError(f"receiving the weights failed: {type(e).__name__}: {e}") from None
    return out


class WeightPusher:
    """The learner's end of weight sync without the disk: rank 0 of the update group, and the engine servers' side
    of it asked over HTTP (:class:`~pipeline.serving.sglang_client.HttpEngine`'s group calls).

    :meth:`join` sets the group up; :meth:`push` sends one update and returns when every worker reports its
    version. Either raises :class:`~pipeline.serving.engine.EngineError` (WeightSyncError included) on any failure;
    the group is then of no further use (a broadcast that failed half-way leaves the ranks out of step), so the
    caller :meth:`close`\\ s it and goes on with the disk path."""

    def __init__(self, servers: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
                 timeout_s: float = 300.0, group_name: str = GROUP_NAME) -> None:
        from pipeline.serving.sglang_client import HttpEngine

        self.engine = HttpEngine(servers[0], control_urls=servers, control_timeout_s=timeout_s + 30)
        self.host, self.port, self.backend = host, port, backend
        self.timeout_s, self.group_name = timeout_s, group_name
        self.group: ProcessGroup | None = None

    async def join(self) -> None:
        import anyio

        from pipeline.serving.launch import free_port

        # Both ends of a rendezvous wait for each other (up to timeout_s), so servers that are not there must fail
        # the join at once (a replayed run's EngineReady names engines long gone).
        if not await self.engine.health():
            raise WeightSyncError(f"the engine servers {self.engine.control_urls} do not all answer /health")
        try:
            port = self.port or free_port(self.host)
        except OSError as e:
            raise WeightSyncError(f"no free port at {self.host} for the weight update group: {e}") from None
        world = len(self.engine.control_urls) + 1

        async def rank0() -> None:
            self.group = await anyio.to_thread.run_sync(
                lambda: open_group(self.backend, self.host, port, 0, world, group_name=self.group_name,
                                   timeout_s=self.timeout_s))

        await self.engine.init_weights_update_group(self.host, port, rank0, backend=self.backend,
                                                    group_name=self.group_name)
        if self.group is None:  # the servers joined and rank 0 did not: cannot happen in one rendezvous
            raise WeightSyncError("the learner did not join its own weight update group")

    async def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        import anyio

        group = self.group
        if group is None:
            raise WeightSyncError("push before join: the weight update group is not set up")
        device = "cuda" if self.backend == "nccl" else "cpu"
        local = {n: t.detach().to(device) for n, t in tensors.items()}
        names, dtypes, shapes = manifest(local)
        await self.engine.update_weights_from_distributed(
            names, dtypes, shapes, version, lambda: anyio.to_thread.run_sync(broadcast, group, local),
            group_name=self.group_name)

    async def close(self) -> None:
        """Leave the group on every side (whatever the servers answer) and close the HTTP client."""
        import anyio

        try:
            if self.group is not None:
                with anyio.move_on_after(30):
                    await self.engine.destroy_weights_update_group(self.group_name, quiet=True)
                group, self.group = self.group, None
                await anyio.to_thread.run_sync(close_group, group)
        finally:
            await self.engine.aclose()
