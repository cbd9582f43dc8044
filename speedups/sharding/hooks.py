"""The module hooks of a sharded model: inputs to each shard's device, outputs back, DataParallel's keys.

Plain classes rather than closures, so that a sharded model can still be pickled and deep-copied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speedups._helpers.moving import LeafMover, moves_itself
from speedups._helpers.tree import tree_map

__all__ = ["MoveInputs", "MoveOutput", "RootIO", "UnwrapStateDict", "WrapStateDict"]


class MoveInputs:
    """Forward pre-hook (with_kwargs): move positional and keyword inputs, nested, to one device."""

    def __init__(self, device: torch.device) -> None:
        self.move = LeafMover(device)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tree_map(self.move, args, moves_itself), tree_map(self.move, kwargs, moves_itself)


class MoveOutput:
    """Forward hook: bring a mapped submodule's output back to the device of the code that called it."""

    def __init__(self, device: torch.device) -> None:
        self.move = LeafMover(device)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        return tree_map(self.move, output, moves_itself)


class RootIO:
    """The root's pre-hook (inputs to the compute device) and forward hook (output to the output device)."""

    def __init__(self, compute_device: torch.device, output_device: torch.device | None) -> None:
        self.compute_device = compute_device
        self.to_compute = LeafMover(compute_device)
        self.to_output = None if output_device is None else LeafMover(output_device)
        self.input_device: torch.device | None = None

    def _see_and_move(self, leaf: Any) -> Any:
        if self.input_device is None and isinstance(leaf, torch.Tensor):
            self.input_device = leaf.device
        return self.to_compute(leaf)

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.input_device = None
        moved_args, moved_kwargs = tree_map(self._see_and_move, (args, kwargs), moves_itself)
        return moved_args, moved_kwargs

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        move = self.to_output or LeafMover(self.input_device or self.compute_device)
        return tree_map(move, output, moves_itself)


class UnwrapStateDict:
    """state_dict post-hook on a DataParallel wrapper: drop its ``module.`` level from the keys."""

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
    ) -> None:
        inner = prefix + "module."
        items = list(state_dict.items())
        state_dict.clear()  # rebuilt in the same order, so keys read exactly as without the wrapper
        for key, value in items:
            state_dict[prefix + key[len(inner) :] if key.startswith(inner) else key] = value
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            inner_meta = prefix + "module"
            for key in [k for k in metadata if k == inner_meta or k.startswith(inner_meta + ".")]:
                new = prefix + key[len(inner_meta) + 1 :] if key != inner_meta else prefix[:-1]
                metadata[new] = metadata.pop(key)


class WrapStateDict:
    """load_state_dict pre-hook on a DataParallel wrapper: add its ``module.`` level to the keys."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)
