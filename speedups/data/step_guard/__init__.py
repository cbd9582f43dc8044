"""What the step given to ``tune_loader`` may do while it is timed: forward and backward, not an update."""

from speedups.data.step_guard.no_updates import NoUpdates, refuse_accumulate_step, step_name, updates_refused
from speedups.data.step_guard.training_state import TrainingState

__all__ = ["NoUpdates", "TrainingState", "refuse_accumulate_step", "step_name", "updates_refused"]
