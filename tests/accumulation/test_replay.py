"""An FSDP2 window saved mid-way as its pending calls (speedups/accumulation/replay.py), in one process.

FSDP2 keeps a window's unreduced gradients in buffers no public API reads, so a checkpoint taken mid-window
saves the calls that made them (inputs, RNG states, the window's buffers) and the step makes them again
before its first call after loading. Here a stand-in FSDP2 module (``set_requires_gradient_sync`` and
nothing else: its gradients sit in ``.grad`` as plain ones do) with dropout and a buffer its forward reads
and writes; the loop draws noise from the global RNG between calls. Resumed after each micro-step, the run
must end torch.equal to the uninterrupted one; without the replay it cannot. Real FSDP2 on 2 gloo ranks is in
tests/checkpoint/test_fsdp2_long_runs.py.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import SpeedupsError, accumulate
from speedups._helpers.layout import LayoutChange
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups.accumulation.replay import decode_inputs, encode_inputs
from speedups.checkpoint.file_format import rng_from_file, rng_to_file

EVERY, CALLS = 4, 10


class Sharded(nn.Module):
    """Stands in for an FSDP2 module: dropout draws from the global RNG, and ``seen`` is read and written by
    every forward (the output depends on how many forwards ran), so a call made again from the wrong buffer
    or RNG state gives other gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1))
        self.register_buffer("seen", torch.zeros(()))
        self.sync_calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.net(x) * (1 + 0.1 * self.seen)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.sync_calls.append(requires_gradient_sync)


def _build(micro_batch_size: int | None = None):
    torch.manual_seed(0)
    model = Sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    split = None if micro_batch_size is None else _split
    step = accumulate(EVERY, opt, model=model, micro_batch_size=micro_batch_size, split=split)(
        lambda batch, scale=1.0: F.mse_loss(model(batch[0]) * scale, batch[1]["y"])
    )
    return model, opt, step


_G = torch.Generator().manual_seed(3)
DATA = [(torch.randn(4, 3, generator=_G), torch.randn(4, 1, generator=_G)) for _ in range(CALLS)]


def _split(args, kwargs, size):
    """The nested batch split along its rows (the dim-0 rule does not reach into the tuple)."""
    (x, target), = args
    return [
        (((x[i : i + size], {"y": target["y"][i : i + size]}),), kwargs) for i in range(0, len(x), size)
    ]


def _call(step, i: int) -> None:
    x, y = DATA[i]
    noise = 0.1 * torch.randn_like(x) + random.random()  # the loop draws from the global RNGs between calls
    step((x + noise, {"y": y}), scale=1.5)  # nested inputs: a tuple holding a tensor and a dict


def _run(start: int = 0, model=None, opt=None, step=None, stop: int | None = None, micro=None):
    if model is None:
        model, opt, step = _build(micro)
        torch.manual_seed(7)
        random.seed(7)
    for i in range(start, CALLS if stop is None else stop):
        _call(step, i)
    return model, opt, step


def _checkpoint(model, opt, step) -> dict:
    """What a checkpoint file holds, through torch.save and torch.load(weights_only=True)."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step.state_dict(),
             "rng": rng_to_file(get_rng_states())}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resume(saved: dict, k: int, micro=None):
    model, opt, step = _build(micro)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    step.load_state_dict(saved["step"])
    set_rng_states(rng_from_file(saved["rng"]))
    return _run(k, model, opt, step)


@pytest.mark.parametrize("micro", [None, 2], ids=["calls", "micro-batches"])
def test_a_window_saved_after_any_micro_step_resumes_bit_for_bit(micro: int | None) -> None:
    ref, _, ref_step = _run(micro=micro)
    assert ref_step.num_updates == 2 and ref_step.pending == 2
    for k in range(1, CALLS):
        model, opt, step = _run(stop=k, micro=micro)
        saved = _checkpoint(model, opt, step)
        pending = k % EVERY
        assert saved["step"]["pending"] == pending and saved["step"]["grads"] is None
        assert (saved["step"]["replay"] is None) == (pending == 0)
        _run(k, model, opt, step)  # the saving run goes on unchanged
        resumed, _, resumed_step = _resume(saved, k, micro)
        for run in (model, resumed):
            for a, b in zip(run.state_dict().values(), ref.state_dict().values(), strict=True):
                assert torch.equal(a, b), (k, (a - b).abs().max())
        assert (resumed_step.step, resumed_step.pending) == (CALLS, 2)
        if pending:  # the gradients of the open window too, made again
            for p, q in zip(resumed.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), k


def test_without_its_pending_calls_the_resumed_window_is_another() -> None:
    """The negative control: the same checkpoint, its calls not made again, ends elsewhere."""
    ref, _, _ = _run()
    model, opt, step = _run(stop=6)
    saved = _checkpoint(model, opt, step)
    model, opt, step = _build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    step.load_state_dict(saved["step"])
    step._acc().replay.due = None  # forget them
    set_rng_states(rng_from_file(saved["rng"]))
    _run(6, model, opt, step)
    assert max((p - q).abs().max() for p, q in zip(model.parameters(), ref.parameters(), strict=True)) > 1e-3


def test_flush_and_discard_after_loading_act_as_on_the_saved_window() -> None:
    """Before any call after loading: flush() makes the pending calls first, then refuses as the saving run
    does (their gradient sync was off); discard() drops them, nothing having been made yet."""
    model, opt, step = _run(stop=6)
    saved = _checkpoint(model, opt, step)
    with pytest.raises(SpeedupsError, match=r"gradient sync was off for the last of them"):
        step.flush()
    other, _, other_step = _build()
    other.load_state_dict(saved["model"])
    other_step.load_state_dict(saved["step"])
    set_rng_states(rng_from_file(saved["rng"]))
    with pytest.raises(SpeedupsError, match=r"gradient sync was off for the last of them"):
        other_step.flush()
    assert other_step.pending == 2 and other_step._acc().replay.due is None  # made again, then refused
    for p, q in zip(other.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    again, _, again_step = _build()
    again_step.load_state_dict(saved["step"])
    assert again_step.discard() == 2 and again_step.pending == 0
    assert all(p.grad is None for p in again.parameters()) and again_step._acc().replay.due is None
    _call(again_step, 6)  # a fresh window, as after any discard
    assert again_step.pending == 1


def test_inputs_round_trip_with_their_containers_and_devices() -> None:
    y = torch.ones(2, requires_grad=True)
    value = ((torch.arange(3), [1, 2.5, None]), {"y": y, "tag": "a", "b": b"x"})
    encoded = encode_inputs(value, "here")
    buffer = io.BytesIO()
    torch.save(encoded, buffer)
    buffer.seek(0)
    back = decode_inputs(torch.load(buffer, weights_only=True))
    assert type(back) is tuple and type(back[0]) is tuple and type(back[0][1]) is list
    assert torch.equal(back[0][0], value[0][0]) and back[0][1] == [1, 2.5, None]
    assert back[1]["y"].requires_grad and back[1]["tag"] == "a" and back[1]["b"] == b"x"
    big = torch.arange(1000)
    assert encode_inputs(big[:3], "here")["tensor"].untyped_storage().nbytes() == 3 * 8  # a view: its own


def test_an_input_a_checkpoint_cannot_hold_is_refused_before_anything_is_saved() -> None:
    class Batch:
        pass

    torch.manual_seed(0)
    model = Sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = accumulate(2, opt, model=model)(lambda x, _batch: model(x).sum())
    step(torch.ones(2, 3), Batch())
    with pytest.raises(SpeedupsError, match=r"micro-step 1 of the open window .* given a Batch.*boundary"):
        step.state_dict()
    assert step.pending == 1  # nothing changed: the window goes on
    step(torch.ones(2, 3), Batch())
    assert step.num_updates == 1


def test_a_window_saved_as_calls_or_as_gradients_loads_only_where_it_fits() -> None:
    _, _, step = _run(stop=2)
    as_calls = step.state_dict()
    torch.manual_seed(0)
    plain = Sharded().net  # the same parameters, not FSDP2
    plain_step = accumulate(EVERY, torch.optim.SGD(plain.parameters(), lr=0.1), model=plain)(
        lambda x: plain(x).sum()
    )
    with pytest.raises(ValueError, match=r"under FSDP2, as the calls .* this step's model is not FSDP2"):
        plain_step.load_state_dict(as_calls)
    plain_step(torch.ones(2, 3))
    assert plain_step.pending == 1
    with pytest.raises(ValueError, match=r"saved as gradients, without FSDP2; this step's model is FSDP2"):
        _build()[2].load_state_dict(plain_step.state_dict())
    change = LayoutChange(saved_world=2, world=1, rank=0, pending=2)
    with pytest.raises(ValueError, match=r"only the same ranks can make again; resumed on 1 process\."):
        step._merge_rank_states([as_calls, as_calls], change)
