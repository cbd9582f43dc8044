"""TensorBoard sink: a resumed run shows every row once, as the CSV file keeps it (issue 37): read back with
TensorBoard's own ``EventAccumulator``, scalar for scalar and step for step, against the run never stopped."""

from __future__ import annotations

import copy
import importlib.util
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from speedups import MetricLogger, accumulate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed"
)


def _shown(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the run in ``folder``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()[SCALARS]}


def _next_second() -> None:
    """Event files are named after the second they were made in, and read in name order: a restarted
    process makes its file in a later second (here, in one process, wait for it)."""
    time.sleep(1.01 - time.time() % 1)


def _run(folder: Path, kill_after: int | None = None, state: dict | None = None) -> dict | None:
    """The nc05 loop: accumulate(3), one row per micro-step at num_updates (and one per update), a checkpoint
    after the 4th call (mid-window: 3 rows at step 1), killed after ``kill_after`` calls, or resumed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = accumulate(3, opt)(lambda x: model(x).pow(2).mean())
    logger = MetricLogger(folder, sinks=["csv", "tensorboard"], every=1)
    train_step.on_update(logger.log_update)
    data = [torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    saved, start = None, 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        train_step.load_state_dict(state["step"])
        logger.load_state_dict(state["logger"])
        start = state["i"]
    for i in range(start, 12):
        train_step(data[i])
        logger.log(train_step.num_updates, micro_loss=float(i))
        if i + 1 == 4:
            saved = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": train_step.state_dict(),
                    "logger": logger.state_dict(),
                    "i": i + 1,
                }
            )
        if kill_after is not None and i + 1 == kill_after:
            break  # the rows so far are in the files (close flushes them); the process would die here
    logger.close()
    return saved


def test_a_row_logged_after_a_mid_window_save_is_shown_once_after_the_resume(tmp_path: Path) -> None:
    _run(tmp_path / "full")
    state = _run(tmp_path / "cut", kill_after=5)  # one more row at step 1 after the save, then killed
    assert state is not None and state["logger"] == {"step": 1, "rows_at_step": 3}
    _next_second()
    _run(tmp_path / "cut", state=state)
    full, cut = _shown(tmp_path / "full"), _shown(tmp_path / "cut")
    assert Counter(s for s, _ in cut["micro_loss"]) == Counter(s for s, _ in full["micro_loss"])  # per step
    assert cut == full  # every tag: the same values at the same steps, in the same order
    assert [s for s, _ in full["micro_loss"]] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert (tmp_path / "cut" / "metrics.csv").read_text() == (tmp_path / "full" / "metrics.csv").read_text()


def test_a_second_resume_from_the_same_checkpoint_is_shown_once_too(tmp_path: Path) -> None:
    """The rows written again by the first resume are read back by the second, as TensorBoard shows them."""
    _run(tmp_path / "full")
    state = _run(tmp_path / "cut", kill_after=6)
    assert state is not None
    for kill_after in (5, None):  # killed again after one row at step 1, then resumed to the end
        _next_second()
        _run(tmp_path / "cut", kill_after=kill_after, state=state)
    assert _shown(tmp_path / "cut") == _shown(tmp_path / "full")


def test_a_checkpoint_before_any_row_hides_every_row_of_the_killed_run(tmp_path: Path) -> None:
    with MetricLogger(tmp_path, sinks="tensorboard") as logger:
        state = logger.state_dict()
        for step in range(3):
            logger.log(step, a=float(step))
    _next_second()
    with MetricLogger(tmp_path, sinks="tensorboard") as resumed:
        resumed.load_state_dict(state)
        resumed.log(0, a=10.0)
    assert _shown(tmp_path) == {"a": [(0, 10.0)]}


def test_rows_at_the_step_are_all_kept_where_another_writer_left_event_files(tmp_path: Path) -> None:
    """Rows written by something else (an earlier release, another tool) cannot be told apart: the step's
    rows stay, as before, and the rows after it are hidden."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tensorboard")) as other:
        for step, value in [(0, 1.0), (1, 2.0), (1, 3.0), (2, 4.0)]:
            other.add_scalar("a", value, step)
    _next_second()
    with MetricLogger(tmp_path, sinks="tensorboard") as resumed:
        resumed.load_state_dict({"step": 1, "rows_at_step": 1})
        resumed.log(2, a=5.0)
    assert _shown(tmp_path) == {"a": [(0, 1.0), (1, 2.0), (1, 3.0), (2, 5.0)]}
