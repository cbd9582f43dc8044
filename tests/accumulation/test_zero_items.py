"""Zero-item micro-batches and windows (all padding): one rule for int, float and tensor counts (issue 13)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from speedups import SpeedupsWarning
from speedups.accumulation import accumulate
from speedups.accumulation.zero_items import GradMask, _mask
from tests._sync_counter import SyncCounter

# 12 micro-batches of 4 rows, accumulate(4): 3 windows. Micro-batch 1 is all padding (a NaN masked mean);
# window 2 (micro-batches 4-7) is all padding: no optimizer step, no scheduler step.
MASKS = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]] + [[0] * 4] * 4 + [[1, 0, 0, 0]] * 4


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 3, generator=g), torch.randn(48, 1, generator=g)
    return x, y, torch.tensor(MASKS, dtype=torch.float32).reshape(48, 1)


def _masked_mean(pred: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((pred - y).pow(2) * mask).sum() / mask.sum()  # 0 / 0 = NaN for an all-padding batch


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _reference(max_grad_norm: float | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Plain PyTorch: per window, the masked mean over every real item of the window; an empty window is
    skipped entirely (no optimizer step, no scheduler step)."""
    x, y, mask = _data()
    model, opt, sched = _model_and_opt()
    for start in range(0, 48, 16):
        w = slice(start, start + 16)
        if mask[w].sum() == 0:
            continue
        opt.zero_grad(set_to_none=True)
        _masked_mean(model(x[w]), y[w], mask[w]).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
    return model, opt, sched


def _run(
    as_count: Callable[[torch.Tensor], Any], **options: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    x, y, mask = _data()
    model, opt, sched = _model_and_opt()
    train_step = accumulate(4, opt, scheduler=sched, **options)(
        lambda xb, yb, mb: (_masked_mean(model(xb), yb, mb), as_count(mb.sum()))
    )
    for i in range(0, 48, 4):
        if i == 28:  # the last call of the empty window
            with pytest.warns(SpeedupsWarning, match="0 items"):
                train_step(x[i : i + 4], y[i : i + 4], mask[i : i + 4])
        else:
            train_step(x[i : i + 4], y[i : i + 4], mask[i : i + 4])
    return model, opt, sched, train_step


COUNTS = {"int": lambda n: int(n), "float": lambda n: float(n), "tensor": lambda n: n}


@pytest.mark.parametrize("options", [{}, {"skip_nonfinite": True}, {"max_grad_norm": 0.5}], ids=str)
@pytest.mark.parametrize("kind", sorted(COUNTS))
def test_zero_item_micro_batches_and_windows_equal_the_plain_reference(kind: str, options: dict) -> None:
    ref, ref_opt, ref_sched = _reference(options.get("max_grad_norm"))
    model, opt, sched, train_step = _run(COUNTS[kind], **options)
    assert train_step.num_updates == 2 and sched.last_epoch == ref_sched.last_epoch == 2
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state["step"] == ref_state["step"]
        torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], atol=1e-6, rtol=0)
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], atol=1e-6, rtol=0)


def test_int_float_and_tensor_counts_give_identical_weights() -> None:
    runs = {kind: _run(as_count) for kind, as_count in COUNTS.items()}
    for kind in ("float", "tensor"):
        for p, q in zip(runs[kind][0].parameters(), runs["int"][0].parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
        assert runs[kind][3].num_updates == runs["int"][3].num_updates == 2


def test_python_counts_stay_sync_free_and_a_tensor_count_costs_one_sync_per_window() -> None:
    for kind, per_window in (("int", 0), ("float", 0), ("tensor", 1)):
        x, y, mask = _data()
        counts = [COUNTS[kind](mask[i : i + 4].sum()) for i in range(0, 16, 4)]  # made before counting
        model, _, _ = _model_and_opt()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam reads its CPU step counter: not ours
        train_step = accumulate(4, opt)(lambda xb, yb, mb, n, m=model: (_masked_mean(m(xb), yb, mb), n))
        with SyncCounter() as counter:
            for i in range(0, 16, 4):  # the first window, with its all-padding micro-batch
                train_step(x[i : i + 4], y[i : i + 4], mask[i : i + 4], counts[i // 4])
        assert train_step.num_updates == 1 and counter.count == per_window, kind
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_zero_count_micro_batch_leaves_the_other_gradients_untouched() -> None:
    x, y, mask = _data()
    model, opt, _ = _model_and_opt()
    reference = copy.deepcopy(model)
    train_step = accumulate(3, opt)(lambda xb, yb, mb: (_masked_mean(model(xb), yb, mb), mb.sum()))
    train_step(x[:4], y[:4], mask[:4])
    train_step(x[4:8], y[4:8], mask[4:8])  # all padding: NaN loss, its gradients must be dropped
    grads = [p.grad.clone() for p in model.parameters()]
    _masked_mean(reference(x[:4]), y[:4], mask[:4]).backward()  # weight 3 items / reference 3 (the first)
    for g, p in zip(grads, reference.parameters(), strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=0)


class _RecordedCopies(TorchFunctionMode):
    """Record ``Tensor.to`` calls; a copy out of ``meta`` (a stand-in for a GPU) gives a real value."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            target = torch.device(args[1])
            self.copies.append((target.type, bool(kwargs.get("non_blocking", False))))
            if args[0].is_meta and target.type == "cpu":
                return torch.tensor(True)
        return func(*args, **kwargs)


def test_the_mask_of_a_gpu_count_is_copied_to_a_cpu_parameter_blocking_and_to_a_gpu_without_waiting() -> None:
    """A shard_model part on the CPU: the device mask must land before torch.where reads it on the host (a
    non-blocking copy to the host is a race); to a GPU the copy stays asynchronous. ``meta`` stands in."""
    owner = GradMask()
    owner.keep = torch.tensor(True, device="meta")  # the count's mask, on "the GPU"
    with _RecordedCopies() as mode:
        kept = _mask(weakref.ref(owner), torch.ones(3))  # the gradient of a CPU parameter
    assert mode.copies == [("cpu", False)] and torch.equal(kept, torch.ones(3))
    owner.keep = torch.tensor(True)  # a host-side mask, a parameter on "the GPU"
    with _RecordedCopies() as mode:
        _mask(weakref.ref(owner), torch.ones(3, device="meta"))
    assert mode.copies == [("meta", True)]


@pytest.mark.parametrize("bad", [-3.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize("where", [0, 2], ids=["first call", "third call"])
def test_a_bad_tensor_count_is_refused_at_the_boundary_and_its_window_dropped(bad: float, where: int) -> None:
    """A count given as a tensor is read once, at the boundary (no sync per call): a negative or non-finite
    one there raises, as the same Python number raises at its call, and the window steps nothing."""
    x, y, mask = _data()
    model, opt, _ = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    calls = [0]

    @accumulate(3, opt)
    def train_step(xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = mb.sum() if calls[0] != where else torch.tensor(bad)
        calls[0] += 1
        return _masked_mean(model(xb), yb, mb), n

    train_step(x[:4], y[:4], mask[:4])
    train_step(x[4:8], y[4:8], mask[4:8])
    with pytest.raises(ValueError, match=r"num_items returned in the window ending at micro-step 3 was "
                       r"negative or not finite.*window was dropped and nothing was stepped"):
        train_step(x[8:12], y[8:12], mask[8:12])
    assert train_step.pending == 0 and train_step.num_updates == 0 and train_step.step == 3
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    torch.testing.assert_close(list(model.parameters()), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"num_items=-3: expected a finite count >= 0"):  # the number form
        accumulate(1, opt)(lambda: (model(x[:4]).mean(), -3))()


def test_a_count_that_requires_grad_is_refused_at_its_call_as_a_prediction_in_its_place() -> None:
    """``return loss, out`` with a batch of 1: a one-element prediction is no item count."""
    x, y, _ = _data()
    model, opt, _ = _model_and_opt()

    @accumulate(2, opt)
    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xb)
        return F.mse_loss(out, yb), out

    with pytest.raises(ValueError, match=r"num_items=tensor\(.*requires grad.*`return loss, out`.*"
                       r"'prediction': out"):
        train_step(x[:1], y[:1])
    assert train_step.step == 0 and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"num_items=tensor\(.*requires grad"):
        train_step(x[:2], y[:2])

    @accumulate(2, opt)
    def detached(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xb)
        return F.mse_loss(out, yb), out.detach()  # a (1, 1) prediction, no gradient: still no count

    with pytest.raises(ValueError, match=r"num_items of shape \(1, 1\).*model's output for one sample"):
        detached(x[:1], y[:1])
    assert detached.step == 0 and all(p.grad is None for p in model.parameters())
