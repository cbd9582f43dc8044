"""Launch environments: one small class per launch style behind :class:`LaunchEnvironment`."""

from speedups._helpers.environments.base import LaunchEnvironment
from speedups._helpers.environments.registry import ENVIRONMENTS, detect

__all__ = ["ENVIRONMENTS", "LaunchEnvironment", "detect"]
