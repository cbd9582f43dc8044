"""A dataset wrapper that reads and writes through to the dataset it wraps, but for its own fields."""

from __future__ import annotations

from typing import Any, ClassVar

from torch.utils.data import Dataset

__all__ = ["ReadThrough"]


class ReadThrough(Dataset):
    """The base of speedups' dataset wrappers (``loader.dataset`` of its loaders).

    Every attribute but the wrapper's own (``_OWN``, set in ``__init__`` with ``object.__setattr__``) is
    read from, written to and deleted from the wrapped ``dataset`` (``loader.dataset.classes``,
    ``loader.dataset.train = False``); ``len()`` is the wrapped dataset's. ``isinstance(loader.dataset,
    MyDataset)`` is False: ``loader.dataset.dataset`` is yours.
    """

    _OWN: ClassVar[frozenset[str]] = frozenset({"dataset"})
    dataset: Any

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # the user's dataset state belongs to the user's dataset
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.dataset, name)
