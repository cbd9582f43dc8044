"""mixed_precision around a whole loop (the optimizer step inside autocast) and its misuse messages,
each against the same loop written in plain PyTorch with autocast around the forward pass only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from speedups import SpeedupsError
from speedups.accumulation import accumulate
from speedups.precision import mixed_precision
from tests._models import mlp


def _mlp() -> torch.nn.Module:
    return mlp(16, 32, 1, activation=torch.nn.ReLU)


def _batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _reference(model: torch.nn.Module, every: int = 1, lr: float = 0.5) -> list[torch.Tensor]:
    """Plain PyTorch: autocast around the forward only, the step outside it; mean over ``every`` calls."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i, (x, y) in enumerate(_batches(), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        (loss / every).backward()
        if i % every == 0:
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_torch_alone_reuses_stale_weight_casts_inside_one_autocast() -> None:
    """The fault the fix removes: a loop inside one plain torch.autocast differs from the reference."""
    model = _mlp()
    want = _reference(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in _batches():
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert max((a - b).abs().max().item() for a, b in zip(_params(model), want, strict=True)) > 1e-3


def test_hand_written_step_inside_with_equals_the_step_outside_autocast() -> None:
    model = _mlp()
    want = _reference(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with mixed_precision("bf16", device_type="cpu"):
        for x, y in _batches():
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    _assert_equal(_params(model), want)


def test_stacked_decorators_inside_an_outer_with_equal_the_reference() -> None:
    model = _mlp()
    want = _reference(copy.deepcopy(model), every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amp = mixed_precision("bf16", device_type="cpu")

    @accumulate(2, opt)
    @amp
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x).float(), y)

    with amp:  # the whole loop inside, as in a script that wraps its main loop
        for x, y in _batches():
            train_step(x, y)
    assert train_step.num_updates == 3
    _assert_equal(_params(model), want)


def test_fp16_amp_step_inside_with_amp_equals_the_gradscaler_recipe() -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in _batches():  # PyTorch's AMP recipe: autocast around the forward, step outside
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(ref(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amp = mixed_precision("fp16", device_type="cpu", init_scale=2.0**10)
    with amp:
        for x, y in _batches():
            amp.backward(F.mse_loss(model(x).float(), y))
            assert amp.step(opt)
            opt.zero_grad()
    _assert_equal(_params(model), _params(ref))


def test_no_cache_clearing_outside_our_contexts() -> None:
    """The process-wide hook acts only while one of our contexts is open: a plain autocast keeps its cache."""
    mixed_precision("bf16", device_type="cpu")  # registers the hook
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = model[0](x)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        again = model[0](x)  # torch's cached copy of the old weight: the same output
    assert torch.equal(first, again)


def test_fp16_step_without_amp_backward_names_the_fix_and_changes_nothing() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amp = mixed_precision("fp16", device_type="cpu")
    x, y = _batches(1)[0]
    for _ in range(2):  # the first iteration, and a later one (the scaler already has a scale)
        with amp:
            loss = F.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad()
    before = _params(model)
    with amp:
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()  # forgot amp.backward
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(SpeedupsError, match=r"amp\.backward\(loss\)"):
        amp.step(opt)
    _assert_equal(_params(model), before)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("name", ["fp32", "FP32", "float32"])
def test_fp32_by_name_is_the_same_as_enabled_false(name: str) -> None:
    amp = mixed_precision(name)
    off = mixed_precision("bf16", enabled=False)
    assert not amp.enabled and amp.dtype is None and amp.scaler is None
    assert repr(amp) == repr(off)
    model = _mlp()
    x = torch.randn(3, 16)
    with amp:
        assert not torch.is_autocast_enabled("cpu")
        assert model(x).dtype == torch.float32
    assert amp(_mlp) is _mlp
    assert mixed_precision(name, device_type="cuda").device_type == "cuda"  # no device needed, as off
