"""A plain process: no launcher, no process group."""

from __future__ import annotations

from collections.abc import Mapping

from speedups._helpers.environments.base import LaunchEnvironment

__all__ = ["SingleProcess"]


class SingleProcess(LaunchEnvironment):
    """Rank 0 of 1: what every process is when no other style recognises it (always detected, so last)."""

    name = "single"

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        return True
