"""The one place that touches torch.distributed internals; everything else calls these functions.

Why privates at all: a process group built straight on a store (no `init_process_group`, no default group) needs
the backend classes' option objects (`ProcessGroupGloo._Options`, `ProcessGroupNCCL.Options` with `_timeout`),
and joining SGLang's weight-update group needs the very helper SGLang builds its side with
(`distributed_c10d._new_process_group_helper`, registered in `_world`), or the two sides never meet.
When a torch upgrade moves one of these, this module is the one to change.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Protocol, cast

import torch
import torch.distributed as dist


class DirectGroup(Protocol):
    """What a backend built straight on a store offers (a c10d Backend at run time, whose stubs omit these)."""

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta, /) -> dist.Work: ...

    def abort(self) -> None: ...


def gloo_group(
    store: dist.Store, *, rank: int, world_size: int, timeout: datetime.timedelta, device: object
) -> DirectGroup:
    """A gloo group on `store` (typically a PrefixStore) bound to `device` (ProcessGroupGloo.create_device)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, missing from the stubs
    opts._timeout = timeout
    opts._devices = [device]
    return cast(DirectGroup, dist.ProcessGroupGloo(store, rank, world_size, opts))


def nccl_group(store: dist.Store, *, rank: int, world_size: int, timeout: datetime.timedelta) -> DirectGroup:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return cast(DirectGroup, dist.ProcessGroupNCCL(store, rank, world_size, opts))


def registered_group(
    *, backend: str, store: dist.Store, group_name: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A group built the way SGLang's init_custom_process_group builds its side: torch's own helper over
    PrefixStore(group_name, store), then registered with an identity rank map so `dist.broadcast(group=...)` works.
    The helper's options argument was renamed pg_options -> backend_options in torch 2.6."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    options = (
        "backend_options"
        if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    # group_name is typed as the NewType GroupName, which older torch lacks: a plain str is what it is at run time
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,  # type: ignore[arg-type]
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
