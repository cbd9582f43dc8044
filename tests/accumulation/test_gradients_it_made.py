"""The step knows which gradients it made: another step's backward (a GAN), a backward outside the step or
inside it, and parameters added to a param group; each against the hand-written loop."""

from __future__ import annotations

import gc
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import SpeedupsError, SpeedupsWarning, accumulate, mixed_precision
from tests._models import linear_data, mlp


@pytest.fixture(autouse=True)
def _steps_of_earlier_tests_gone() -> None:
    """A step alone in its process takes the short path: earlier tests' steps must not linger (the
    two-step cases here make their company themselves)."""
    gc.collect()


def _flat(*modules: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for m in modules for p in m.parameters()])


# ----------------------------------------------------------------------------- a GAN, ported as taught
def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return G, D


def _gan_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _d_loss(D: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    return _bce(D(real), 1.0) + _bce(D(fake.detach()), 0.0)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("every", [1, 2])
def test_a_gan_without_requires_grad_tricks_equals_the_hand_written_loop(every: int, fp16: bool) -> None:
    """dcgan/main.py's shape: D's windows never hold what G's loss left on D (there, netD.zero_grad())."""
    data = _gan_data(6)
    G, D = _gan()
    og, od = torch.optim.Adam(G.parameters(), 1e-2), torch.optim.Adam(D.parameters(), 1e-2)
    sd, sg = torch.amp.GradScaler("cpu", enabled=fp16), torch.amp.GradScaler("cpu", enabled=fp16)
    for i, (real, z) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            fake = G(z)
            ld = _d_loss(D, real, fake)
        sd.scale(ld / every).backward()
        if (i + 1) % every == 0:
            sd.step(od), sd.update(), od.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            lg = _bce(D(fake), 1.0)
        torch.autograd.backward(sg.scale(lg / every), inputs=list(G.parameters()))  # G's gradients only
        if (i + 1) % every == 0:
            sg.step(og), sg.update(), og.zero_grad()
    ref = _flat(G), _flat(D)

    G, D = _gan()
    og, od = torch.optim.Adam(G.parameters(), 1e-2), torch.optim.Adam(D.parameters(), 1e-2)
    amp = mixed_precision("fp16" if fp16 else "fp32", device_type="cpu")

    @accumulate(every, od)
    @amp
    def d_step(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return _d_loss(D, real, fake)

    @accumulate(every, og)
    @amp
    def g_step(fake: torch.Tensor) -> torch.Tensor:
        return _bce(D(fake), 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: this is the recipe
        for real, z in data:
            with amp:
                fake = G(z)
            d_step(real, fake)
            g_step(fake)
    assert torch.equal(_flat(G), ref[0]) and torch.equal(_flat(D), ref[1])


def test_another_steps_open_window_is_kept_whole_while_a_step_runs() -> None:
    G, D = _gan()
    od, og = torch.optim.SGD(D.parameters(), 0.1), torch.optim.SGD(G.parameters(), 0.1)
    d_step = accumulate(3, od)(lambda real, fake: _d_loss(D, real, fake))
    g_step = accumulate(1, og)(lambda fake: _bce(D(fake), 1.0))
    real, z = _gan_data(1)[0]
    d_step(real, G(z))
    window = [p.grad.clone() for p in D.parameters()]
    g_step(G(z))  # its backward runs through D
    assert all(torch.equal(p.grad, w) for p, w in zip(D.parameters(), window, strict=True))
    assert g_step.num_updates == 1 and d_step.pending == 1


def test_a_step_made_while_another_steps_window_is_open_sets_that_window_aside() -> None:
    """A step alone registers no window (its short path); a second step made mid-window must still find it
    open and set it aside while it runs, and a step that goes leaves the other alone again."""
    G, D = _gan()
    od, og = torch.optim.SGD(D.parameters(), 0.1), torch.optim.SGD(G.parameters(), 0.1)
    d_step = accumulate(3, od)(lambda real, fake: _d_loss(D, real, fake))
    (real, z), (real2, z2) = _gan_data(2)
    d_step(real, G(z).detach())
    d_step(real2, G(z2).detach())  # the short path, mid-window
    window = [p.grad.clone() for p in D.parameters()]
    g_step = accumulate(1, og)(lambda fake: _bce(D(fake), 1.0))  # made now, with D's window open
    g_step(G(z))  # its backward runs through D
    assert all(torch.equal(p.grad, w) for p, w in zip(D.parameters(), window, strict=True))
    assert g_step.num_updates == 1 and d_step.pending == 2
    del g_step
    gc.collect()
    d_step(real, G(z).detach())  # alone again: the window closes as usual
    assert d_step.num_updates == 1 and all(p.grad is None for p in D.parameters())


def test_two_steps_over_one_optimizer_are_refused_while_the_other_window_is_open_and_may_take_turns() -> None:
    """Interleaved, each would step the shared optimizer on the other's half window (three warnings that
    blamed a backward outside, a hand-made step and a zero_grad): refused, naming both steps, before
    anything of the call runs. One after the other, window by window, they are exact."""
    model = mlp(3, 8, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    main = accumulate(2, opt)(lambda x: model(x).pow(2).mean())
    aux = accumulate(2, opt)(lambda x: model(x).abs().mean())
    x = torch.randn(4, 3)
    main(x)
    grads = [p.grad.clone() for p in model.parameters()]
    aux_line, main_line = (inspect.getsourcelines(f.__wrapped__)[1] for f in (aux, main))  # where defined
    told = (
        rf"<lambda> \(defined at .*:{aux_line}\) and .*<lambda> \(defined at .*:{main_line}\) are two "
        r"@accumulate steps over one optimizer \(SGD\), both alive.*window is open \(1 of 2.*discard\(\).*"
        r"return main_loss \+ aux_loss"
    )
    with pytest.raises(SpeedupsError, match=told):
        aux(x)
    assert aux.step == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main(x)  # main's window applied: aux may run its own now
        aux(x)
        aux(x)
        main(x)
    assert main.num_updates == 1 and aux.num_updates == 1 and main.pending == 1


# ------------------------------------------------------------------------ a backward outside the step
def test_gradients_no_step_made_are_dropped_at_a_window_start_with_one_warning() -> None:
    x, y = linear_data(16)
    model, ref = mlp(3, 8, 1), mlp(3, 8, 1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
    train_step = accumulate(2, opt)(lambda x, y: F.mse_loss(model(x), y))
    with pytest.warns(SpeedupsWarning, match=r"no step made.*dropped.*return every loss") as record:
        for i in range(0, 16, 4):
            if i % 8 == 0:  # a stray backward before each window: what the hand loop's zero_grad() drops
                model(x[:2]).sum().backward()
            train_step(x[i : i + 4], y[i : i + 4])
    assert len(record) == 1 and record[0].filename == __file__
    for i in range(0, 16, 8):
        ref_opt.zero_grad()
        for j in (i, i + 4):
            (F.mse_loss(ref(x[j : j + 4]), y[j : j + 4]) / 2).backward()
        ref_opt.step()
    torch.testing.assert_close(_flat(model), _flat(ref), rtol=0, atol=1e-7)


# ------------------------------------------------------------------------- a backward inside the step
def _two_heads() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Linear(16, 1), nn.Linear(16, 3)


def _aux_data() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g), torch.randint(3, (8,), generator=g))
        for _ in range(4)
    ]


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_a_backward_inside_the_step_is_warned_once_and_the_sum_is_exact(fp16: bool) -> None:
    data = _aux_data()
    body, reg, cls = _two_heads()
    params = [*body.parameters(), *reg.parameters(), *cls.parameters()]
    opt = torch.optim.SGD(params, lr=0.2)
    for i, (x, y, c) in enumerate(data):  # the hand loop: both losses / N
        h = body(x)
        (F.mse_loss(reg(h), y) / 2).backward(retain_graph=True)
        (F.cross_entropy(cls(h), c) / 2).backward()
        if i % 2:
            opt.step(), opt.zero_grad()
    ref = torch.cat([p.detach().reshape(-1) for p in params])

    def run(inner: bool) -> torch.Tensor:
        body, reg, cls = _two_heads()
        params = [*body.parameters(), *reg.parameters(), *cls.parameters()]
        amp = mixed_precision("fp16" if fp16 else "fp32", device_type="cpu")

        @accumulate(2, torch.optim.SGD(params, lr=0.2))
        @amp
        def step(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            h = body(x)
            main, aux = F.mse_loss(reg(h), y), F.cross_entropy(cls(h), c)
            if inner:
                aux.backward(retain_graph=True)
                return main
            return main + aux

        for batch in data:
            step(*batch)
        return torch.cat([p.detach().reshape(-1) for p in params])

    told = r"backward\(\) ran inside the step.*1/2.*`return main \+ aux`"
    with pytest.warns(SpeedupsWarning, match=told) as rec:
        run(inner=True)
    assert len(rec) == 1 and rec[0].filename == __file__
    assert ("fp16 loss scale" in str(rec[0].message)) is fp16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(inner=False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 if fp16 else 1e-6)


@pytest.mark.parametrize("alone", [True, False], ids=["one step (the short path)", "two steps"])
@pytest.mark.parametrize("call", [1, 2], ids=["the window's first call", "a later call"])
def test_a_loss_backward_left_in_the_step_is_refused_with_the_fix_and_nothing_counted(
    call: int, alone: bool
) -> None:
    """The migration leftover `loss.backward(); return loss`: torch's "backward through the graph a second
    time" (whose retain_graph=True advice would train wrong) becomes the fix; the call counts nothing."""
    other = None if alone else _steps_on(mlp(3, 8, 1))
    model = mlp(3, 8, 1)
    calls = [0]

    @accumulate(4, torch.optim.SGD(model.parameters(), 0.1))
    def step(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = model(x).pow(2).mean()
        if calls[0] == call:
            loss.backward()  # the leftover
        return loss

    for _ in range(call - 1):
        step(torch.randn(4, 3))
    weights = _flat(model).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # the inner-backward warning comes first
        with pytest.raises(SpeedupsError, match=r"ran `loss.backward\(\)` itself.*remove the backward\(\)"):
            step(torch.randn(4, 3))
    assert step.step == call - 1 and step.pending == call - 1 and torch.equal(_flat(model), weights)
    del other


def test_autograd_grad_inside_the_step_is_not_a_backward() -> None:
    """A gradient penalty (torch.autograd.grad with create_graph) leaves no .grad: nothing to warn about."""
    model = mlp(3, 8, 1)
    train_step = accumulate(2, torch.optim.SGD(model.parameters(), 0.1))

    @train_step
    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        out = model(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        return out + gx.pow(2).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            step(torch.randn(4, 3))
    assert step.num_updates == 2


# -------------------------------------------------------------------------- parameters added to a group
@pytest.mark.parametrize("how", ["extend", "append", "new list"])
def test_parameters_added_to_an_existing_group_are_normalised_and_clipped(how: str) -> None:
    """The usual "unfreeze the backbone" edit of a param group, half-way: as a group added, it is seen."""
    x, y = linear_data(32)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(3, 8, 1)
        return model, torch.optim.SGD(model[2].parameters(), lr=0.5)

    def unfreeze(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        group = opt.param_groups[0]
        new = list(model[0].parameters())
        if how == "extend":
            group["params"].extend(new)
        elif how == "append":
            for p in new:
                group["params"].append(p)
        else:
            group["params"] = group["params"] + new

    ref, ref_opt = build()
    for i in range(0, 32, 8):
        if i == 16:
            unfreeze(ref, ref_opt)
        for j in (i, i + 4):
            (F.mse_loss(ref(x[j : j + 4]), y[j : j + 4]) / 2).backward()
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]], 0.05)
        ref_opt.step()
        ref.zero_grad(set_to_none=True)

    model, opt = build()
    train_step = accumulate(2, opt, max_grad_norm=0.05)(lambda x, y: F.mse_loss(model(x), y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # the frozen layer's gradients before unfreezing
        for i in range(0, 32, 4):
            if i == 16:
                unfreeze(model, opt)
            train_step(x[i : i + 4], y[i : i + 4])
    torch.testing.assert_close(_flat(model), _flat(ref), rtol=0, atol=1e-6)


def test_a_parameter_added_twice_to_the_groups_is_refused_when_the_next_window_starts() -> None:
    model = mlp(3, 8, 1)
    head, body = torch.optim.SGD(model[2].parameters(), 0.1), torch.optim.SGD(model[0].parameters(), 0.1)
    train_step = accumulate(2, [head, body])(lambda x: model(x).pow(2).mean())
    train_step(torch.randn(4, 3))
    train_step.flush()
    before = [p.grad for p in model.parameters()]
    head.param_groups[0]["params"].append(model[0].weight)  # body's already
    with pytest.raises(SpeedupsError, match=r"listed twice among the step's optimizers.*each parameter once"):
        train_step(torch.randn(4, 3))
    assert train_step.pending == 0 and train_step.step == 1 and train_step.num_updates == 1
    assert before == [None] * 4 and all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- the open window changed by someone else
def _steps_on(model: nn.Module, every: int = 4):
    return accumulate(every, torch.optim.SGD(model.parameters(), 0.1))(lambda x: model(x).pow(2).mean())


@pytest.mark.parametrize("how", ["backward outside", "zero_grad(set_to_none=False)"])
def test_an_open_window_changed_between_calls_is_warned_once(how: str) -> None:
    model = mlp(3, 8, 1)
    train_step = _steps_on(model)
    told = r"changed between the previous call.*Fix: return every loss"
    with pytest.warns(SpeedupsWarning, match=told) as rec:
        for i in range(8):
            train_step(torch.randn(4, 3))
            if i % 4 in (0, 1):  # inside each window
                if how == "backward outside":
                    model(torch.randn(2, 3)).sum().backward()
                else:
                    model.zero_grad(set_to_none=False)
    assert len(rec) == 1 and rec[0].filename == __file__


def _step_with_a_backward_inside(model: nn.Module, on_call: Callable[[int], bool]) -> Any:
    """``@accumulate(4)`` over ``model`` whose function runs a ``backward()`` itself on the calls (counted
    from 1) where ``on_call`` says so."""
    calls = [0]

    @accumulate(4, torch.optim.SGD(model.parameters(), 0.1))
    def step(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = model(x)
        if on_call(calls[0]):
            out.sum().backward(retain_graph=True)
        return out.pow(2).mean()

    return step


@pytest.mark.parametrize("alone", [True, False], ids=["one step (the short path)", "two steps"])
@pytest.mark.parametrize("call", [1, 2], ids=["the window's first call", "a later call"])
def test_a_backward_inside_the_step_on_one_call_of_the_window_is_warned(call: int, alone: bool) -> None:
    other = None if alone else _steps_on(mlp(3, 8, 1))
    model = mlp(3, 8, 1)
    step = _step_with_a_backward_inside(model, lambda n: n % 4 == call % 4)  # that call of each window
    assert step._acc().guard.alone is alone  # the path this case is about
    with pytest.warns(SpeedupsWarning, match=r"backward\(\) ran inside the step.*1/4") as rec:
        for _ in range(8):
            step(torch.randn(4, 3))
    assert len(rec) == 1 and rec[0].filename == __file__
    del other


@pytest.mark.parametrize("alone", [True, False], ids=["one step (the short path)", "two steps"])
@pytest.mark.parametrize("call", [0, 2], ids=["the window's first call", "a later call"])
def test_the_once_a_window_checks_run_on_every_window_not_only_the_first(call: int, alone: bool) -> None:
    """A backward() inside the step, or an outer fp16 autocast, that starts in the third window is found
    there: the checks done once a window run on each window's first call, whatever the path."""
    other = None if alone else _steps_on(mlp(3, 8, 1))
    model = mlp(3, 8, 1)
    step = _step_with_a_backward_inside(model, lambda n: n == 8 + call + 1)  # in the third window only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(8):  # two clean windows: the short path is taken from the second call on
            step(torch.randn(4, 3))
    assert step._acc().guard.alone is alone and step._acc().short
    with pytest.warns(SpeedupsWarning, match=r"backward\(\) ran inside the step \(micro-step (9|11)\).*1/4"):
        for _ in range(4):
            step(torch.randn(4, 3))
    del step
    gc.collect()

    @accumulate(4, torch.optim.SGD(model.parameters(), 0.1))
    def plain(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    for _ in range(8 + call):
        plain(torch.randn(4, 3))
    assert plain._acc().guard.alone is alone and plain._acc().short
    refused = pytest.raises(SpeedupsError, match=r"inside an fp16 autocast \(cpu\) entered outside it")
    with refused, torch.autocast("cpu", dtype=torch.float16):  # around the loop from here on
        for _ in range(4 - call + 1):  # entered mid-window: found at the next window's first call
            plain(torch.randn(4, 3))
    assert plain.step == 8 + (call and 4)
    del other


def test_a_backward_inside_a_step_of_one_call_windows_is_exact_and_not_warned() -> None:
    data = _aux_data()
    body, reg, cls = _two_heads()
    params = [*body.parameters(), *reg.parameters(), *cls.parameters()]
    opt = torch.optim.SGD(params, lr=0.2)
    for x, y, c in data:
        h = body(x)
        (F.mse_loss(reg(h), y) + F.cross_entropy(cls(h), c)).backward()
        opt.step(), opt.zero_grad()
    ref = torch.cat([p.detach().reshape(-1) for p in params])
    body, reg, cls = _two_heads()
    params = [*body.parameters(), *reg.parameters(), *cls.parameters()]

    @accumulate(1, torch.optim.SGD(params, lr=0.2))
    def step(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = body(x)
        F.cross_entropy(cls(h), c).backward(retain_graph=True)  # weight 1 is the window's weight here
        return F.mse_loss(reg(h), y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in data:
            step(*batch)
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in params]), ref, rtol=0, atol=1e-6)


def test_parameters_joining_in_the_middle_of_a_window_with_gradients_are_warned() -> None:
    model = mlp(3, 8, 1)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    train_step = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # the not-yet-joined layer's gradients, dropped
        for _ in range(4):
            train_step(torch.randn(4, 3))
    train_step(torch.randn(4, 3))
    opt.param_groups[0]["params"].extend(model[0].parameters())  # mid-window, model[0] holds gradients
    with pytest.warns(SpeedupsWarning, match=r"2 parameters joined .* middle of a window.*pending == 0"):
        for _ in range(3):  # seen when the step next reads its parameters: the update, at the latest
            train_step(torch.randn(4, 3))
