"""A step's life in an interactive session: interrupted mid-window, redefined, dropped; what dir() shows.

A notebook user stops a loop with Ctrl-C in the middle of a window, edits the cell that defines the step and
runs it again. The old step is unreachable (its name holds the new one) but, in a reference cycle or a kept
traceback, not yet collected: it must not block the new one, whatever the garbage collector did. A step
that is still reachable is named with where it was defined, so that two steps of one name are told apart.
"""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from speedups import SpeedupsError, SpeedupsWarning, accumulate
from speedups.accumulation.ownership import OWNERSHIP
from tests._models import linear_data, mlp

CELL_SETUP = """
import torch, torch.nn.functional as F
from speedups import accumulate
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""
CELL_STEP = """
@accumulate(4, optimizer)
def train_step(x, y):
    return F.mse_loss(model(x), y){edit}
"""
CELL_METHOD = """
class Trainer:
    @accumulate(4, optimizer)
    def train_step(self, x, y):
        return F.mse_loss(model(x), y){edit}
trainer = Trainer()
train_step = trainer.train_step
"""
CELL_INSTANCE = """
class Trainer:
    def __init__(self):
        self.train_step = accumulate(4, optimizer)(self._step)  # a step made per instance
    def _step(self, x, y):
        return F.mse_loss(model(x), y){edit}
trainer = Trainer()
train_step = trainer.train_step
"""
CELL_LOOP = """
for i, (x, y) in enumerate(batches):
    if i == stop_at:
        raise KeyboardInterrupt  # Ctrl-C in the middle of a window
    train_step(x, y)
"""


@pytest.fixture(autouse=True)
def _no_step_alive() -> None:
    """Steps of earlier tests collected: these count the live ones."""
    gc.collect()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = linear_data(4 * n)
    return [(x[i : i + 4], y[i : i + 4]) for i in range(0, 4 * n, 4)]


def _hand_loop(batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """The plain loop the two runs of the cells stand for: the interrupted run's one full window (its open
    one dropped, as `optimizer.zero_grad()` at the top of a hand loop drops it), then every window of the
    edited loss (times ``scale``); SGD, windows of 4."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = [(batches[:4], 1.0), (batches[:4], scale), (batches[4:8], scale)]
    for window, factor in windows:
        for x, y in window:
            (F.mse_loss(model(x), y) * factor / 4).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "cell", [CELL_STEP, CELL_METHOD, CELL_INSTANCE], ids=["function", "method of a class", "per instance"]
)
@pytest.mark.parametrize("collector", [True, False], ids=["gc on", "gc off"])
def test_a_step_redefined_after_an_interrupted_window_runs_as_the_plain_loop(
    cell: str, collector: bool
) -> None:
    batches = _batches(8)
    ns: dict = {"batches": batches}
    exec(CELL_SETUP, ns)
    exec(cell.format(edit=""), ns)
    was_enabled = gc.isenabled()
    if not collector:
        gc.disable()
    try:
        ns["stop_at"] = 6  # one window applied, 2 micro-steps of the second one accumulated
        with pytest.raises(KeyboardInterrupt):
            exec(CELL_LOOP, ns)
        assert ns["train_step"].pending == 2 and ns["train_step"].num_updates == 1
        exec(cell.format(edit=" * 2.0"), ns)  # the cell, edited and run again
        ns["stop_at"] = None
        told = r"a window (Trainer\.)?_?(train_)?step \(defined at <string>:\d+\) left open \(2 of 4 micro-"
        with pytest.warns(SpeedupsWarning, match=told + r"steps\).*dropped.*flush\(\).*discard\(\)"):
            exec(CELL_LOOP, ns)
    finally:
        if was_enabled:
            gc.enable()
    assert ns["train_step"].num_updates == 2 and ns["train_step"].pending == 0
    got = torch.cat([p.detach().reshape(-1) for p in ns["model"].parameters()])
    torch.testing.assert_close(got, _hand_loop(batches, 2.0), rtol=0, atol=1e-6)


def test_a_step_still_reachable_is_named_with_where_each_was_defined_and_can_be_discarded() -> None:
    batches = _batches(4)
    ns: dict = {"batches": batches, "stop_at": 2}
    exec(CELL_SETUP, ns)
    exec(CELL_STEP.format(edit=""), ns)
    with pytest.raises(KeyboardInterrupt):
        exec(CELL_LOOP, ns)
    kept = ns["train_step"]  # still referenced: a live step whose window is open
    exec(CELL_STEP.format(edit=""), ns)  # the same function, made again
    with pytest.raises(SpeedupsError) as caught:
        ns["train_step"](*batches[0])
    message = str(caught.value)
    told = (
        r"train_step \(defined at <string>:2\) and an earlier step made from the same definition are two "
        r"@accumulate steps over one optimizer \(SGD\), both alive, and the other's window is open \(2 of 4 "
        r"micro-steps\).*flush\(\).*discard\(\)"
    )
    assert re.search(told, message), message
    assert ns["train_step"].step == 0  # refused before anything of the call ran
    before = [p.detach().clone() for p in ns["model"].parameters()]
    assert kept.discard() == 2 and kept.pending == 0 and kept.step == 2 and kept.num_updates == 0
    assert all(p.grad is None for p in ns["model"].parameters())
    assert kept.discard() == 0  # nothing open: nothing to drop
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dropped window left nothing behind to warn about
        for x, y in batches:
            ns["train_step"](x, y)
    assert ns["train_step"].num_updates == 1
    # the same as one plain SGD step on the 4 batches, from the weights before: the discarded window is gone
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        for p, b in zip(model.parameters(), before, strict=True):
            p.copy_(b)
    for x, y in batches:
        (F.mse_loss(model(x), y) / 4).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(list(ns["model"].parameters()), list(model.parameters()), rtol=0, atol=1e-7)


def test_discard_drops_the_open_window_as_the_hand_loop_drops_it_with_zero_grad() -> None:
    x, y = linear_data(24)
    model = mlp(3, 8, 1)
    ref = mlp(3, 8, 1)
    opt, ref_opt = torch.optim.Adam(model.parameters(), 0.01), torch.optim.Adam(ref.parameters(), 0.01)

    @accumulate(3, opt)
    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(xb), yb)

    for i in range(6):  # micro-steps 0-1 dropped, then two full windows
        train_step(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
        if i == 1:
            assert train_step.discard() == 2
    for window in ((2, 3, 4), (5,)):  # the hand loop: the dropped window never reaches the optimizer
        for i in window:
            (F.mse_loss(ref(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]) / 3).backward()
        if len(window) == 3:
            ref_opt.step()
            ref_opt.zero_grad()
    assert train_step.num_updates == 1 and train_step.pending == 1 and train_step.step == 6
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), rtol=0, atol=0)
    torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_a_retired_step_no_longer_watches_its_optimizer() -> None:
    model = mlp(3, 8, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    old = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    old(torch.randn(4, 3))  # its window stays open
    del old
    assert not list(OWNERSHIP._steps)  # gone at once, without a collection
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() was called by hand" from the dead step
        model.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()


def test_dir_of_a_step_lists_its_api_and_the_function_s_own_names() -> None:
    model = torch.nn.Linear(2, 1)

    @accumulate(2, torch.optim.SGD(model.parameters(), 0.1))
    def train_step(x: torch.Tensor) -> torch.Tensor:
        """Docstring."""
        return model(x).mean()

    names = set(dir(train_step))
    wanted = {"flush", "discard", "epoch", "pending", "num_updates", "step", "every", "is_boundary",
              "on_update", "before_update", "state_dict", "load_state_dict", "last_grad_norm", "scaler"}
    assert wanted <= names and "__doc__" in names and "__name__" in names
    assert not {n for n in names if n.startswith("_self_")}

    class Trainer:
        @accumulate(2, torch.optim.SGD(model.parameters(), 0.1))
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return model(x).mean()

    assert wanted <= set(dir(Trainer().step))


@pytest.mark.parametrize(
    "form", ["mean loss (the short path)", "item counts", "micro-batches", "auto micro-batches"]
)
def test_a_ctrl_c_inside_the_step_s_backward_leaves_no_half_gradients_in_the_window(form: str) -> None:
    """Ctrl-C lands in the step's own backward, after some parameters got their share: the window cannot be
    trusted, so it is dropped (said in a note), and training goes on as the hand loop restarted there; a
    call split by "auto" puts the window back as the call found it instead."""
    x, y = linear_data(40)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)]
    model, ref = mlp(3, 8, 1), mlp(3, 8, 1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
    hit = {"on": False}

    def interrupt(grad: torch.Tensor) -> torch.Tensor:  # on the first layer's output: after the head got its
        if hit["on"]:
            hit["on"] = False
            raise KeyboardInterrupt
        return grad

    options = {"micro-batches": {"micro_batch_size": 4}, "auto micro-batches": {"micro_batch_size": "auto"}}

    @accumulate(3, opt, **options.get(form, {}))
    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> object:
        h = model[0](xb)
        h.register_hook(interrupt)
        loss = F.mse_loss(model[2](model[1](h)), yb)
        return (loss, len(yb)) if form == "item counts" else loss

    train_step(*batches[0])
    hit["on"] = True
    with pytest.raises(KeyboardInterrupt) as caught:
        train_step(*batches[1])
    kept = form == "auto micro-batches"  # the window as the call found it
    assert train_step.pending == (1 if kept else 0) and train_step.step == 1
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert kept or "window (2 call(s)" in notes, notes
    for batch in batches[1:]:
        train_step(*batch)
    window = [batches[0], *batches[1:3]] if kept else batches[1:4]  # the dropped window's calls never count
    for xb, yb in window:
        (F.mse_loss(ref(xb), yb) / 3).backward()
    ref_opt.step()
    assert train_step.num_updates == 1
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), rtol=0, atol=1e-6)
