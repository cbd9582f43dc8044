"""A checkpoint's optimizer state in another memory layout than the model it loads into.

``Optimizer.load_state_dict`` keeps the strides the state was saved with. Saved while ``fast_kernels`` made
the convolution weights channels_last and loaded into a plain (contiguous) run, or the other way, a fused
step pairs a weight and its state in memory order: wrong elements together (0.047 off after 3 steps of a
conv net with Adam(fused=True)). ``load_checkpoint`` (and ``RunDirectory.resume``, through it) lays every
state tensor of a parameter's shape, and the gradients a mid-window step restores, out as the parameter is.
Each run is compared with the plain loop that never used fast_kernels, within 1e-5 (the float rounding of
channels_last convolutions on this CPU: seen 3e-8)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import RunDirectory, SpeedupsWarning, accumulate, fast_kernels, load_checkpoint, save_checkpoint
from speedups._helpers.state_strides import follow_strides, state_follows_params

CL = torch.channels_last
_OPTIMIZERS = [
    ("Adam", {"fused": True}),
    ("AdamW", {"fused": True, "amsgrad": True}),
    ("SGD", {"momentum": 0.9, "fused": True}),
    ("Adam", {"foreach": True}),
]
_IDS = [f"{name}-{options}" for name, options in _OPTIMIZERS]
# fused Adam in the quick loop, the other optimizers with the slow tests
_CASES = [
    pytest.param(name, options, id=ident, marks=[] if i == 0 else [pytest.mark.slow])
    for i, ((name, options), ident) in enumerate(zip(_OPTIMIZERS, _IDS, strict=True))
]
_STEPS = 6  # 3 before the checkpoint, 3 after


def _conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 10, 10, generator=g), torch.randn(4, 2, generator=g)) for _ in range(_STEPS)]


def _switch(model: nn.Module) -> fast_kernels:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # tf32/cudnn "auto" off CUDA: not under test
        switch = fast_kernels(model, tf32=False, cudnn_benchmark=False)
    assert switch.convolutions == 2
    return switch


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _plain(name: str, options: dict) -> list[torch.Tensor]:
    """The reference: the hand-written loop, no fast_kernels, no checkpoint."""
    model = _conv_net()
    _train(model, getattr(torch.optim, name)(model.parameters(), lr=0.01, **options), _batches())
    return [p.detach().clone() for p in model.parameters()]


def _mismatched(opt: torch.optim.Optimizer) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(parameter strides, state strides) of each state tensor of its parameter's shape laid out otherwise."""
    return [
        (p.stride(), v.stride())
        for p, state in opt.state.items()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride()
    ]


@pytest.mark.parametrize("saved_under", ["fast_kernels", "plain"])
@pytest.mark.parametrize(("name", "options"), _CASES)
def test_a_checkpoint_resumes_in_the_other_layout_as_the_plain_loop(
    tmp_path: Path, name: str, options: dict, saved_under: str
) -> None:
    """Saved under fast_kernels and loaded into a plain run, or saved plain and loaded under fast_kernels
    (switched on before the load): 3 more steps land where the plain loop does."""
    want = _plain(name, options)
    batches = _batches()
    model = _conv_net()
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **options)
    switch = _switch(model) if saved_under == "fast_kernels" else None
    _train(model, opt, batches[:3])
    saved = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    if switch is not None:
        switch.restore()

    resumed = _conv_net()
    resumed_opt = getattr(torch.optim, name)(resumed.parameters(), lr=0.01, **options)
    other = _switch(resumed) if saved_under == "plain" else None
    load_checkpoint(tmp_path / "ckpt.pt", model=resumed, optimizer=resumed_opt)
    weight = resumed[0].weight
    assert weight.is_contiguous(memory_format=CL) == (other is not None)  # the run's layout, kept
    assert _mismatched(resumed_opt) == []  # every state tensor laid out as its weight
    for i, state in enumerate(resumed_opt.state.values()):  # values exact: only the layout moved
        assert all(torch.equal(v, saved[i][k]) for k, v in state.items())
    _train(resumed, resumed_opt, batches[3:])
    if other is not None:
        other.restore()
    for got, ref in zip(resumed.parameters(), want, strict=True):
        torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-5)


def test_without_the_fix_the_fused_step_is_far_off(tmp_path: Path) -> None:
    """The test above would see the fault: state loaded as torch leaves it is 1e-2 off with a fused Adam."""
    want = _plain("Adam", {"fused": True})
    batches = _batches()
    model = _conv_net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    switch = _switch(model)
    _train(model, opt, batches[:3])
    state = copy.deepcopy(opt.state_dict())  # as saved: restore() below moves the live state back
    switch.restore()
    resumed = _conv_net()
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01, fused=True)
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(state)  # torch alone: the channels_last strides stay
    assert _mismatched(resumed_opt)
    _train(resumed, resumed_opt, batches[3:])
    off = max((a.detach() - b).abs().max().item() for a, b in zip(resumed.parameters(), want, strict=True))
    assert off > 1e-3


@pytest.mark.parametrize(("name", "options"), _CASES[:3])
def test_the_file_read_without_speedups_resumes_a_plain_fused_run_as_the_plain_loop(
    tmp_path: Path, name: str, options: dict
) -> None:
    """The file is plain torch (``torch.load(path, weights_only=True)``): saved under fast_kernels, its
    tensors are written contiguous, so a plain model and a fused optimizer loaded by torch alone pair them
    right (the state's channels_last strides would survive Optimizer.load_state_dict)."""
    want = _plain(name, options)
    batches = _batches()
    model = _conv_net()
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **options)
    switch = _switch(model)
    _train(model, opt, batches[:3])
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    switch.restore()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = _conv_net()
    resumed_opt = getattr(torch.optim, name)(resumed.parameters(), lr=0.01, **options)
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optimizer"])
    assert _mismatched(resumed_opt) == []
    _train(resumed, resumed_opt, batches[3:])
    for got, ref in zip(resumed.parameters(), want, strict=True):
        torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-5)


def test_a_mid_window_step_and_a_run_directory_resume_in_the_other_layout(tmp_path: Path) -> None:
    """RunDirectory.resume loads through load_checkpoint: a mid-window @accumulate(2) checkpoint saved under
    fast_kernels resumes a plain run; the open window's gradients follow their weights too."""
    batches = _batches()

    def build() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        model = _conv_net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)

        @accumulate(2, opt)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        return model, opt, step

    # the plain loop: a window of 2 batches, mean of their losses, one Adam step
    ref = _conv_net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
    for i in range(0, _STEPS, 2):
        ref_opt.zero_grad()
        for x, y in batches[i : i + 2]:
            (F.mse_loss(ref(x), y) / 2).backward()
        ref_opt.step()

    model, opt, step = build()
    switch = _switch(model)
    run = RunDirectory(tmp_path / "run", stop_on=None)
    run.resume(model=model, optimizer=opt, step=step)
    for x, y in batches[:3]:  # a window and a half: the open window's gradient is channels_last
        step(x, y)
    assert step.pending == 1 and model[0].weight.grad.is_contiguous(memory_format=CL)
    run.save()
    run.close()
    switch.restore()

    model, opt, step = build()
    run = RunDirectory(tmp_path / "run", stop_on=None)
    run.resume(model=model, optimizer=opt, step=step)
    run.close()
    assert step.pending == 1 and _mismatched(opt) == []
    assert all(p.grad is None or p.grad.stride() == p.stride() for p in model.parameters())
    for x, y in batches[3:]:
        step(x, y)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)


def test_follow_strides_moves_only_dense_tensors_of_the_shape_and_keeps_values() -> None:
    weight = nn.Parameter(torch.randn(4, 3, 2, 2).contiguous(memory_format=CL))
    state = torch.randn(4, 3, 2, 2)
    before = state.clone()
    assert follow_strides(state, weight) and state.stride() == weight.stride() and torch.equal(state, before)
    assert not follow_strides(state, weight)  # already so
    assert not follow_strides(torch.zeros(()), weight)  # a step counter: another shape
    expanded = torch.randn(4, 3, 2, 1).expand(4, 3, 2, 2)  # overlapping strides: nothing to copy onto
    assert not follow_strides(torch.randn(4, 3, 2, 2), expanded)
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    opt.state[weight]["momentum_buffer"] = torch.randn(4, 3, 2, 2)
    weight.grad = torch.randn(4, 3, 2, 2)
    assert state_follows_params(opt, grads=True) == 1
    assert opt.state[weight]["momentum_buffer"].stride() == weight.grad.stride() == weight.stride()
