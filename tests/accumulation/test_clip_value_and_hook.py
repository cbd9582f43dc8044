"""Clip by value (``max_grad_value=``), the hook on the final gradients (``before_update``), and a step
called from a ``torch.compile``d function; each against the hand-written loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import accumulate, mixed_precision
from tests._models import mlp

CLIP = 0.05


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 8, generator=g), 3 * torch.randn(16, 1, generator=g)) for _ in range(n)]


def _model() -> nn.Module:
    return mlp(8, 32, 1, activation=nn.ReLU)


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _hand(every: int, fp16: bool, *, clip_scaled: bool = False, edit=None) -> torch.Tensor:
    """PyTorch's AMP recipe: scale(loss / N).backward() x N, unscale_, clip_grad_value_, step, update."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for i, (x, y) in enumerate(_data()):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.mse_loss(m(x), y)
        scaler.scale(loss / every).backward()
        if (i + 1) % every == 0:
            if not clip_scaled:
                scaler.unscale_(opt)
            if edit is None:
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP)
            else:
                edit(list(m.parameters()))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return _flat(m)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("every", [1, 3])
def test_max_grad_value_equals_the_amp_recipe(every: int, fp16: bool) -> None:
    ref = _hand(every, fp16)
    m = _model()

    @accumulate(every, torch.optim.SGD(m.parameters(), lr=0.1), max_grad_value=CLIP)
    @mixed_precision("fp16" if fp16 else "fp32", device_type="cpu")
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    for x, y in _data():
        step(x, y)
    assert torch.equal(_flat(m), ref)
    if fp16:  # the negative control: clipping the still-scaled gradients is another result
        assert not torch.allclose(_hand(every, fp16, clip_scaled=True), ref, atol=1e-4)


def test_an_fp16_overflow_is_skipped_although_clipping_by_value_would_make_it_finite() -> None:
    m = _model()
    before = _flat(m)

    @accumulate(1, torch.optim.SGD(m.parameters(), lr=0.1), max_grad_value=CLIP)
    @mixed_precision("fp16", device_type="cpu")
    def step(x: torch.Tensor) -> torch.Tensor:
        return m(x).float().sum() * float("inf")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(4, 8))
    assert step.last_step_skipped and step.num_updates == 0 and torch.equal(_flat(m), before)


def test_mixed_precision_step_clips_by_value_as_the_recipe() -> None:
    ref = _hand(1, True)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    amp = mixed_precision("fp16", device_type="cpu")
    for x, y in _data():
        with amp:
            loss = F.mse_loss(m(x), y)
        amp.backward(loss)
        amp.step(opt, max_grad_value=CLIP)
        opt.zero_grad()
    assert torch.equal(_flat(m), ref)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_grad_value": -1.0}, ValueError, r"max_grad_value=-1.0: must be a positive finite number"),
        ({"max_grad_value": "0.5"}, TypeError, r"max_grad_value='0.5'"),
        ({"max_grad_value": float("inf")}, ValueError, r"max_grad_value=inf"),
        ({"max_grad_value": 0.5, "max_grad_norm": 1.0}, ValueError, r"two ways to clip; give one"),
    ],
)
def test_bad_clipping_is_refused_when_decorating(kwargs: dict, error: type, match: str) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        accumulate(2, opt, **kwargs)
    amp = mixed_precision("fp16", device_type="cpu")
    with pytest.raises(error, match=match):
        amp.step(opt, **kwargs)


# ------------------------------------------------------------------------------------------ before_update
def _noise(params: list[torch.Tensor]) -> None:
    """Deterministic "gradient noise": a fixed pattern scaled by each gradient's own mean."""
    for p in params:
        assert p.grad is not None
        p.grad.add_(torch.linspace(-1, 1, p.grad.numel()).view_as(p.grad) * p.grad.abs().mean())


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_before_update_sees_the_final_gradients_just_before_the_optimizer_step(fp16: bool) -> None:
    def edit(params: list[torch.Tensor]) -> None:
        torch.nn.utils.clip_grad_value_(params, CLIP)
        _noise(params)

    ref = _hand(3, fp16, edit=edit)
    m = _model()
    seen: list[int] = []

    @accumulate(3, torch.optim.SGD(m.parameters(), lr=0.1), max_grad_value=CLIP)
    @mixed_precision("fp16" if fp16 else "fp32", device_type="cpu")
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    handle = step.before_update(_noise)
    step.before_update(lambda params: seen.append(step.num_updates))
    for x, y in _data():
        step(x, y)
    assert torch.equal(_flat(m), ref)
    assert seen == [0, 1]  # once per update, before it is counted
    handle.remove()
    before = _flat(m)
    for x, y in _data()[:3]:  # the noise hook removed: a plain clipped update
        step(x, y)
    assert seen == [0, 1, 2] and not torch.equal(_flat(m), before)


def test_before_update_is_not_called_for_a_skipped_update_and_refuses_a_bad_hook() -> None:
    m = _model()
    calls: list[int] = []

    @accumulate(1, torch.optim.SGD(m.parameters(), lr=0.1))
    @mixed_precision("fp16", device_type="cpu")
    def step(x: torch.Tensor) -> torch.Tensor:
        return m(x).float().sum() * float("inf")

    step.before_update(lambda params: calls.append(len(params)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(4, 8))
    assert calls == [] and step.last_step_skipped
    with pytest.raises(TypeError, match=r"before_update\(.*\): expected a function of one argument"):
        step.before_update(lambda: None)
    with pytest.raises(TypeError, match=r"before_update"):
        step.before_update(3)


# -------------------------------------------------------------------------------------- torch.compile
@pytest.mark.slow
def test_a_compiled_function_that_calls_the_step_trains_as_the_eager_one() -> None:
    data = _data()

    def run(compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m = _model()

        @accumulate(2, torch.optim.SGD(m.parameters(), lr=0.1), max_grad_norm=1.0)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(m(x), y)

        def train_iteration(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return step(x * 2.0, y)

        fn = torch.compile(train_iteration, backend="aot_eager") if compiled else train_iteration
        losses = [fn(x, y) for x, y in data]
        assert step.num_updates == 3 and step.step == 6
        return _flat(m), losses

    (ref, ref_losses), (got, losses) = run(False), run(True)
    assert torch.equal(got, ref)
    pairs = zip(losses, ref_losses, strict=True)
    assert all(loss.grad_fn is None and torch.equal(loss, r) for loss, r in pairs)


@pytest.mark.slow
def test_a_compiled_caller_runs_the_step_and_its_function_eagerly_and_compiles_none_of_our_frames() -> None:
    """The step's call is left to eager by dynamo's frame strategy (no is_compiling() check per call): its
    function runs as it does eagerly, and no frame of the step is compiled, whether the window's first call
    or a later one is the first to run under the compiled caller."""
    import torch._dynamo

    seen: list[bool] = []
    m = _model()

    @accumulate(3, torch.optim.SGD(m.parameters(), lr=0.1))
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return F.mse_loss(m(x), y)

    step(*_data()[0])  # one eager call first: the compiled caller then starts mid-window (the short path)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    run = torch.compile(lambda x, y: step(x * 2.0, y), backend="eager")
    for x, y in _data():
        run(x, y)
    assert seen == [False] * 7 and step.step == 7 and step.num_updates == 2
    assert counters["frames"]["total"] == 1, dict(counters["frames"])  # the caller's; a traced step: 6


@pytest.mark.slow
def test_fullgraph_compile_of_a_function_calling_the_step_names_accumulate_and_the_fix() -> None:
    """fullgraph=True cannot hold the step (backward, optimizer update): the error said `torch.compiler
    .disable()` was called inside a compiled region; it names @accumulate and what to compile instead."""
    m = _model()
    step = accumulate(2, torch.optim.SGD(m.parameters(), lr=0.1))(lambda x, y: F.mse_loss(m(x), y))
    run = torch.compile(lambda x, y: step(x * 2.0, y), backend="eager", fullgraph=True)
    told = r"an @accumulate step runs eagerly.*torch.compile\(model, fullgraph=True\)"
    with pytest.raises(Exception, match=told):
        run(*_data()[0])
    assert step.step == 0 and all(p.grad is None for p in m.parameters())


@pytest.mark.slow
def test_a_step_method_called_from_a_compiled_method_trains_as_the_eager_one() -> None:
    class Loop:
        def __init__(self) -> None:
            self.model = _model()
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.step = accumulate(2, opt)(self.loss)

        def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.model(x), y)

        def iteration(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.step(x, y)

    eager, compiled = Loop(), Loop()
    run = torch.compile(compiled.iteration, backend="aot_eager")  # dynamo; inductor sets env vars
    for x, y in _data():
        eager.iteration(x, y)
        run(x, y)
    assert compiled.step.num_updates == 3
    assert torch.equal(_flat(compiled.model), _flat(eager.model))


@pytest.mark.parametrize("where", ["before_update hook", "optimizer.step"])
def test_an_fp16_update_that_raises_leaves_the_step_usable(where: str) -> None:
    """The GradScaler had unscaled the window: left so, every later update would raise forever."""
    data = _data(3)

    class Once(torch.optim.SGD):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            self.fail = where == "optimizer.step"

        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            if self.fail:
                self.fail = False
                raise RuntimeError("broke once")
            return super().step(closure)

    def run(batches: list, raising: bool) -> tuple[torch.Tensor, float]:
        m = _model()

        @accumulate(1, Once(m.parameters(), lr=0.1) if raising else torch.optim.SGD(m.parameters(), lr=0.1))
        @mixed_precision("fp16", device_type="cpu", init_scale=256.0)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(m(x), y)

        def broke(params: list[torch.Tensor]) -> None:
            raise RuntimeError("broke once")

        handle = step.before_update(broke) if raising and where == "before_update hook" else None
        for i, (x, y) in enumerate(batches):
            if raising and i == 0:
                with pytest.raises(RuntimeError, match="broke once"):
                    step(x, y)
                if handle is not None:
                    handle.remove()
                continue
            step(x, y)
        assert step.num_updates == len(batches) - raising and step.pending == 0
        return _flat(m), step.scaler.get_scale()

    # The failed window is dropped, the loss scale kept: the run equals one that never saw that batch.
    (got, got_scale), (ref, ref_scale) = run(data, raising=True), run(data[1:], raising=False)
    assert torch.equal(got, ref) and got_scale == ref_scale == 256.0
