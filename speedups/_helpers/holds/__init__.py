"""What one process holds alone: an exclusive hold on a path (:class:`PathHold`, one writer per file or run
directory), and the open files a forked child must not keep (:func:`drop_in_children`)."""

from speedups._helpers.holds.fork_guard import drop_in_children, on_fork_in_child
from speedups._helpers.holds.path_hold import PathHold

__all__ = ["PathHold", "drop_in_children", "on_fork_in_child"]
