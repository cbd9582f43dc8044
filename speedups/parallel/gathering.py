"""Tip 9 for evaluation: :func:`gather` brings all ranks' per-sample outputs together, once each, in order.

Each rank evaluates its share of the data (a :func:`~speedups.distributed` loader) and keeps its outputs;
after the loop one call gathers them on every rank. With the loader, the samples each rank was given are
known, so padding duplicates (``even=True``) are dropped and the rows are put back in dataset order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from speedups._helpers import env
from speedups._helpers.arrival import arrive
from speedups._helpers.tree import tree_map
from speedups.data.distributed_loader import DistributedLoader
from speedups.data.prefetching import DevicePrefetcher
from speedups.errors import SpeedupsError

__all__ = ["gather"]


def gather(x: Any, loader: DataLoader | None = None) -> Any:
    """Gather this rank's outputs from all ranks; with ``loader``, each sample once and in dataset order.

    Call it once after the evaluation loop, on every rank (never inside a loop whose batch counts differ
    between ranks). ``x`` is this rank's outputs for all the samples its loader gave it in the last pass,
    concatenated along dim 0 (``torch.cat(outputs)``): a tensor, or a nested container (dict, list, tuple,
    namedtuple, dataclass) of tensors that all have that many rows. Lengths may differ between ranks; the
    other dims and dtypes must agree.

    Without ``loader``: the concatenation of every rank's ``x`` in rank order. With a
    :func:`~speedups.distributed` loader (``even=True`` or ``False``, shuffled or not): row ``i`` is the
    output of the ``i``-th sample of the dataset, each sample exactly once (padding duplicates dropped);
    samples never given (``drop_last=True``) are absent. In a single process the same rules hold.

    Sync points: collectives (one ``all_gather_object`` of the shapes, one ``all_gather`` per tensor);
    results come back on each tensor's device, on every rank.

    Args:
        x: this rank's outputs, rows along dim 0.
        loader: the :class:`~speedups.DistributedLoader` that produced them (or ``prefetch_to_device`` of
            it), after its pass.

    Returns:
        The same structure as ``x``, each tensor holding the rows of all ranks.

    Raises:
        TypeError: a leaf of ``x`` is not a tensor, or ``loader`` is not a
            :func:`~speedups.distributed` loader.
        ValueError: the leaves' row counts differ, or exceed what the loader gave this rank.
        SpeedupsError: the ranks disagree on the structure, dims or dtypes; or ``loader`` spans several ranks
            but no process group is running.

    Example:
        >>> from speedups import distributed
        >>> loader = distributed(DataLoader(list(range(6)), batch_size=4, shuffle=True), rank=0, world_size=1)
        >>> out = torch.cat([batch * 10 for batch in loader])      # this rank's outputs, in loader order
        >>> gather(out, loader).tolist()                           # dataset order
        [0, 10, 20, 30, 40, 50]
    """
    if isinstance(loader, DevicePrefetcher):
        loader = loader.loader  # prefetch_to_device(loader): the samples are its loader's
    leaves: list[torch.Tensor] = []
    tree_map(lambda leaf: leaves.append(_tensor(leaf)), x)
    rows = {int(t.shape[0]) for t in leaves}
    if len(rows) > 1:
        raise ValueError(
            f"gather(x): its tensors have different row counts {sorted(rows)}; every tensor must hold one "
            f"row per sample. Concatenate each output along dim 0 over the whole loop (torch.cat(outputs))."
        )
    n = rows.pop() if rows else 0
    indices = None if loader is None else _indices(loader, n)
    ranks = env.world_size() if env.pg_ready() else 1
    if loader is not None and ranks == 1 and loader.distributed_sampler.num_replicas > 1:  # type: ignore[attr-defined]
        raise SpeedupsError(
            f"gather(x, loader): the loader is split across {loader.distributed_sampler.num_replicas} "  # type: ignore[attr-defined]
            f"ranks but no process group is running, so the other ranks' rows cannot be fetched. Call "
            f"init_distributed() (or ddp_wrap) first, or launch with torchrun / speedups.launch."
        )
    if ranks > 1:
        arrive("gather")  # called on some ranks only: it says so, then fails at the collective timeout
        leaves = _all_gather(leaves, n, indices)
        if indices is not None:
            indices, leaves = leaves[-1], leaves[:-1]
    if indices is not None:
        order = _first_in_dataset_order(indices.cpu())
        leaves = [t[order.to(t.device)] for t in leaves]
    it = iter(leaves)
    return tree_map(lambda _: next(it), x)


def _tensor(leaf: Any) -> torch.Tensor:
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        shown = type(leaf).__name__ if not isinstance(leaf, torch.Tensor) else "a 0-dim tensor"
        raise TypeError(
            f"gather(x): found {shown}; every leaf must be a tensor with one row per sample (dim 0). Stack "
            f"per-sample values first: torch.stack(values) or torch.cat(batch_outputs)."
        )
    return leaf


def _indices(loader: DataLoader, n: int) -> torch.Tensor:
    if not isinstance(loader, DistributedLoader):
        raise TypeError(
            f"gather(x, loader={type(loader).__name__}): expected the loader made by distributed(...) that "
            f"produced x, so the samples of each rank are known. Pass it, or loader=None for rank "
            f"order."
        )
    if loader.epoch < 0:
        raise SpeedupsError(
            "gather(x, loader): the loader has not run a pass yet, so no sample was given. Call gather after "
            "the evaluation loop over that loader."
        )
    given = list(loader.distributed_sampler)  # this rank's indices in the last pass (same epoch, same start)
    batch_size = loader.batch_size
    yielded = len(given)
    if loader.drop_last and batch_size:  # the last, incomplete batch was never handed out
        yielded -= yielded % batch_size
    if n != yielded:
        raise ValueError(
            f"gather(x, loader): x has {n} rows but the loader gave this rank {yielded} samples in its last "
            f"pass. Pass one row per sample, concatenated over exactly that whole pass (a loop that stopped "
            f"early, or kept some batches only, gives rows that cannot be matched to samples): "
            f"torch.cat([model(x) for x, _ in loader])."
        )
    return torch.tensor(given[:n], dtype=torch.int64)


def _all_gather(leaves: list[torch.Tensor], n: int, indices: torch.Tensor | None) -> list[torch.Tensor]:
    dist = torch.distributed
    if indices is not None:
        leaves = [*leaves, indices]
    spec = [(tuple(t.shape[1:]), str(t.dtype)) for t in leaves]
    specs: list[Any] = [None] * dist.get_world_size()
    with env.on_comm_device() as comm:  # this rank's GPU under NCCL (object collectives use the current one)
        dist.all_gather_object(specs, (n, spec))
    counts = [count for count, _ in specs]
    if any(other != spec for _, other in specs):
        raise SpeedupsError(
            f"gather(x): the ranks' outputs differ in structure, trailing dims or dtype: "
            f"{[other for _, other in specs]} (per rank: (dims after dim 0, dtype) of each tensor). Give "
            f"every rank the same kind of output."
        )
    most = max(counts)
    out = []
    for t in leaves:
        home = t.device
        moved = t.to(comm)
        padded = moved.new_zeros((most, *t.shape[1:]))
        padded[:n] = moved
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        out.append(torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)]).to(home))
    return out


def _first_in_dataset_order(indices: torch.Tensor) -> torch.Tensor:
    """Positions of each distinct index's first occurrence, sorted by index (dataset order)."""
    order = torch.argsort(indices, stable=True)
    ranked = indices[order]
    keep = torch.ones_like(ranked, dtype=torch.bool)
    keep[1:] = ranked[1:] != ranked[:-1]
    return order[keep]
