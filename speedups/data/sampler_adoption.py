"""Adopting a loader's own ``DistributedSampler`` (code written for torchrun) in ``distributed()``.

Only a plain ``DistributedSampler`` over the loader's dataset is adopted: its split is reproduced exactly
(same ranks, shuffle, seed, ``drop_last``); an argument of ``distributed()`` that contradicts it raises.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["adopted", "check_adoptable"]


def check_adoptable(inner: DistributedSampler, loader: DataLoader) -> None:
    """Refuse a sampler whose split ``distributed()`` could not reproduce exactly."""
    if type(inner) is not DistributedSampler:
        raise TypeError(
            f"distributed(loader): its sampler is a {type(inner).__name__}, a DistributedSampler subclass "
            f"whose own rules distributed() would lose by rebuilding it as a plain DistributedSampler. Keep "
            f"your loader as it is (call sampler.set_epoch(epoch) yourself), or give distributed() a "
            f"DataLoader built with shuffle=True/False and no sampler."
        )
    covered, held = len(inner.dataset), len(loader.dataset)  # type: ignore[arg-type]
    if covered != held:
        raise ValueError(
            f"distributed(loader): its DistributedSampler covers {covered} samples but the loader's dataset "
            f"has {held}: the sampler was built over another dataset. Build it over the loader's dataset, "
            f"DistributedSampler(dataset, ...), or leave the sampler out."
        )


def adopted(
    inner: DistributedSampler,
    shuffle: bool | None,
    seed: int,
    rank: int | None,
    world_size: int | None,
    said: str,
) -> tuple[bool, int, int, int]:
    """The settings of a user's ``DistributedSampler``; an argument that contradicts it raises."""
    theirs = {"shuffle": inner.shuffle, "rank": inner.rank, "world_size": inner.num_replicas}
    given = {"shuffle": shuffle, "rank": rank, "world_size": world_size}
    clash = [f"{k}={given[k]!r} (its {k}={theirs[k]!r})" for k in theirs if given[k] not in (None, theirs[k])]
    if seed not in (0, inner.seed):
        clash.append(f"seed={seed!r} (its seed={inner.seed!r})")
    if clash:
        raise ValueError(
            f"{said}: the loader already has a DistributedSampler, which distributed() adopts as it is, but "
            f"{', '.join(clash)}. Leave those arguments out, or build the loader with shuffle=True/False and "
            f"no sampler, and distributed() adds one."
        )
    return bool(inner.shuffle), int(inner.seed), int(inner.rank), int(inner.num_replicas)
