"""LossTracker against hand-computed weighted means, graph release, and sync counts."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from speedups import LossTracker, SpeedupsError, SpeedupsWarning, tracking
from tests._sync_counter import SyncCounter


@pytest.fixture(params=["cpu-read", "device-path"])
def update_path(request, monkeypatch) -> str:
    """Run a test on both update paths: CPU values read at once, and the sync-free device path.

    Without a GPU the device path is reached by telling the tracker that CPU reads are not free.
    """
    if request.param == "device-path":
        monkeypatch.setattr(tracking, "_CPU_READS_ARE_FREE", False)
    return request.param


def test_weighted_mean_matches_hand_computation() -> None:
    values = [0.5, 1.25, 3.0, 0.125]
    counts = [4, 4, 2, 7]
    tracker = LossTracker()
    for i, (v, n) in enumerate(zip(values, counts, strict=True)):
        # mix tensors, Python floats and tensor counts
        value = torch.tensor(v) if i % 2 == 0 else v
        tracker.update(value, n=torch.tensor(n) if i == 2 else n)
    expected = sum(v * n for v, n in zip(values, counts, strict=True)) / sum(counts)
    assert tracker.compute() == pytest.approx(expected, abs=1e-6)
    assert len(tracker) == 4


def test_tracker_holds_no_graph(update_path) -> None:
    x = torch.randn(512, 512, requires_grad=True)
    h = x * 2
    loss = (h**2).mean()
    value = loss.item()
    r = weakref.ref(h)
    tracker = LossTracker()
    tracker.update(loss)
    del h, loss
    gc.collect()
    assert r() is None
    held = [v for v in vars(tracker).values() if isinstance(v, torch.Tensor)]
    held += [
        v
        for lst in vars(tracker).values()
        if isinstance(lst, list)
        for v in lst
        if isinstance(v, torch.Tensor)
    ]
    assert not any(t.requires_grad or t.grad_fn is not None for t in held)
    # The device path keeps the detached value as a tensor; on the CPU it was read into a Python float.
    assert bool(held) == (update_path == "device-path")
    assert tracker.compute() == pytest.approx(value, abs=1e-6)


def test_hundreds_of_updates_make_no_host_sync(monkeypatch) -> None:
    monkeypatch.setattr(tracking, "_CPU_READS_ARE_FREE", False)  # the device path, on CPU stand-ins
    losses = [torch.rand(()) for _ in range(600)]  # more than one fold of the buffer (256)
    counts = [torch.tensor(3.0) for _ in range(600)]
    tracker = LossTracker()
    with SyncCounter() as counter:
        for loss, n in zip(losses, counts, strict=True):
            tracker.update(loss, n=n)
    assert counter.count == 0
    with SyncCounter() as counter:
        mean = tracker.compute()
    assert counter.count == 1  # .tolist() of the 3-slot state: one device-to-host read
    assert mean == pytest.approx(torch.stack(losses).double().mean().item(), abs=1e-6)


def test_mean_is_exact_across_buffer_folds(update_path) -> None:
    torch.manual_seed(0)
    values = torch.rand(700, dtype=torch.float64) * 10
    counts = torch.randint(1, 9, (700,))
    tracker = LossTracker()
    for i, (v, n) in enumerate(zip(values, counts, strict=True)):
        if i % 3 == 0:
            tracker.update(v.float(), n=int(n))  # float32 tensor, Python count
        elif i % 3 == 1:
            tracker.update(v, n=n)  # float64 tensor, tensor count
        else:
            tracker.update(float(v), n=int(n))  # host value
    expected = (values * counts).sum() / counts.sum()
    assert tracker.compute() == pytest.approx(expected.item(), rel=1e-6)
    assert len(tracker) == 700


def test_cpu_tensors_are_read_at_once_and_summed_in_float64() -> None:
    """On the CPU a read is not a sync: update() keeps Python numbers, exactly like `.item()` would."""
    torch.manual_seed(0)
    losses = [
        torch.rand((), dtype=dtype) * 4 for dtype in [torch.float32, torch.float16, torch.bfloat16] * 200
    ]
    counts = [1 + i % 7 for i in range(len(losses))]
    tracker = LossTracker()
    for i, (loss, n) in enumerate(zip(losses, counts, strict=True)):
        weight = torch.tensor(n) if i % 5 == 0 else n  # CPU tensor counts are read too
        tracker.update(loss.requires_grad_() * 1, n=weight)
    attrs = list(vars(tracker).values())
    held = [v for v in attrs if isinstance(v, torch.Tensor)]
    held += [v for a in attrs if isinstance(a, list) for v in a if isinstance(v, torch.Tensor)]
    assert held == []  # no tensor kept, nothing buffered: nothing to fold, nothing to sync
    expected = math.fsum(loss.item() * n for loss, n in zip(losses, counts, strict=True)) / sum(counts)
    assert tracker.compute() == pytest.approx(expected, rel=1e-12)
    assert len(tracker) == len(losses)


def test_cpu_tensor_counts_follow_the_tensor_rule(update_path) -> None:
    """A tensor count is not checked per update on either path (zero is allowed); a read checks the total."""
    tracker = LossTracker()
    tracker.update(torch.tensor(5.0), n=torch.tensor(0))
    tracker.update(torch.tensor(2.0), n=torch.tensor(3))
    assert tracker.compute() == pytest.approx(2.0, abs=1e-12)
    empty = LossTracker()
    empty.update(torch.tensor(5.0), n=torch.tensor(0.0))
    with pytest.raises(SpeedupsError, match=r"total item count is 0\.0"):
        empty.compute()


def test_cpu_updates_are_not_reported_as_syncs_by_profile_steps() -> None:
    """On the CPU the tracker's reads are no sync, so the profiler must not advise "use LossTracker"."""
    from speedups import profile_steps

    model = torch.nn.Linear(8, 1)
    tracker = LossTracker()
    with profile_steps(warmup=0, sample_every=1) as prof:
        for x in prof.iter([torch.randn(4, 8) for _ in range(6)]):
            loss = model(x).pow(2).mean()
            loss.backward()
            tracker.update(loss, len(x))
            tracker.update(loss.detach().bfloat16(), n=torch.tensor(2))  # the general CPU path too
    assert prof.summary().syncs_per_step == 0
    assert "sync-bound" not in {a.rule for a in prof.advice()}


def test_sync_counter_can_see_a_sync() -> None:
    """The counter is not blind: .item() counts."""
    with SyncCounter() as counter:
        torch.ones(()).item()
    assert counter.count == 1


def test_nonfinite_values_are_left_out_counted_and_warned() -> None:
    tracker = LossTracker()
    tracker.update(torch.tensor(2.0), n=2)
    tracker.update(torch.tensor(float("nan")), n=5)
    tracker.update(float("inf"))
    tracker.update(4.0, n=2)
    with pytest.warns(SpeedupsWarning, match="2 of 4 recorded values were NaN or inf"):
        assert tracker.compute() == pytest.approx(3.0)
    assert tracker.num_nonfinite == 2
    only_bad = LossTracker()
    only_bad.update(torch.tensor(float("nan")))
    with pytest.warns(SpeedupsWarning):
        assert math.isnan(only_bad.compute())


def test_epochs_history_and_reset() -> None:
    tracker = LossTracker()
    tracker.update(1.0)
    tracker.update(3.0)
    assert tracker.end_epoch() == pytest.approx(2.0)
    tracker.update(torch.tensor(5.0))
    assert tracker.end_epoch() == pytest.approx(5.0)
    assert tracker.history == pytest.approx([2.0, 5.0])
    assert len(tracker) == 0
    tracker.update(1.0)
    tracker.reset()
    assert len(tracker) == 0 and tracker.history == pytest.approx([2.0, 5.0])


def test_state_dict_round_trip_continues_the_same_mean() -> None:
    a = LossTracker()
    a.update(torch.tensor(1.0), n=3)
    a.end_epoch()
    a.update(torch.tensor(2.0), n=1)
    b = LossTracker()
    b.load_state_dict(a.state_dict())
    for t in (a, b):
        t.update(torch.tensor(6.0), n=1)
    assert b.compute() == pytest.approx(a.compute()) == pytest.approx(4.0)
    assert b.history == a.history and len(b) == len(a) == 2
    with pytest.raises(ValueError, match="expected a dict with keys"):
        b.load_state_dict({"sum": 1.0})


def test_tqdm_postfix_and_format() -> None:
    from tqdm import tqdm

    tracker = LossTracker()
    assert f"{tracker:.3f}" == "nan"  # empty: formats, does not raise
    tracker.update(torch.tensor(0.123456))
    assert f"{tracker:.3f}" == "0.123" and str(tracker) == "0.1235"
    assert float(tracker) == pytest.approx(0.123456)
    bar = tqdm(range(1), disable=False, file=open("/dev/null", "w"))  # noqa: SIM115
    bar.set_postfix(loss=tracker)
    assert "loss=0.1235" in str(bar)
    bar.close()


def test_compute_before_any_update_is_a_clear_error() -> None:
    with pytest.raises(SpeedupsError, match=r"no value recorded.*tracker.update"):
        LossTracker().compute()


@pytest.mark.parametrize(
    "value, n, error, match",
    [
        (torch.ones(3), 1, ValueError, r"shape \(3,\).*scalar"),
        ("0.5", 1, TypeError, r"value='0.5'"),
        ([0.5], 1, TypeError, r"value=\[0.5\]"),
        (True, 1, TypeError, r"value=True"),
        (torch.tensor(1), 1, TypeError, r"floating-point"),
        (0.5, 0, ValueError, r"n=0.*positive"),
        (0.5, -2, ValueError, r"n=-2"),
        (0.5, float("nan"), ValueError, r"n=nan"),
        (0.5, "3", TypeError, r"n='3'"),
        (0.5, torch.ones(2), ValueError, r"one-element"),
        (torch.tensor(0.5), 0, ValueError, r"n=0.*positive"),
        (torch.tensor(0.5), -2.5, ValueError, r"n=-2.5"),
        (torch.tensor(0.5), True, TypeError, r"n=True"),
        (torch.tensor(0.5), torch.ones(2), ValueError, r"one-element"),
        (torch.tensor(0.5), torch.tensor(1j), ValueError, r"one-element real"),
        (torch.tensor(0.5, dtype=torch.complex64), 1, TypeError, r"floating-point"),
    ],
)
def test_bad_input_raises_and_records_nothing(value, n, error, match, update_path) -> None:
    tracker = LossTracker()
    tracker.update(torch.tensor(1.0))
    with pytest.raises(error, match=match):
        tracker.update(value, n=n)
    assert len(tracker) == 1 and tracker.compute() == pytest.approx(1.0)


@pytest.mark.cuda
def test_cuda_updates_stay_on_device_without_sync() -> None:
    tracker = LossTracker()
    losses = [torch.rand((), device="cuda") for _ in range(20)]
    with SyncCounter() as counter:
        for loss in losses:
            tracker.update(loss, n=2)
    assert counter.count == 0
    assert tracker.compute() == pytest.approx(torch.stack(losses).double().mean().item(), abs=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"sum": "x", "count": 1, "nonfinite": 0, "updates": 1, "history": []},
        {"sum": 1.0, "count": 1, "nonfinite": float("nan"), "updates": 1, "history": []},
        {"sum": 1.0, "count": 1, "nonfinite": 0, "updates": -1, "history": []},
        {"sum": 1.0, "count": 1, "nonfinite": 0, "updates": 1, "history": None},
    ],
)
def test_load_state_dict_leaves_the_tracker_unchanged_on_bad_values(bad) -> None:
    tracker = LossTracker()
    tracker.update(1.0)
    tracker.update(3.0, n=3)
    with pytest.raises(ValueError, match=r"load_state_dict\(state\): state\["):
        tracker.load_state_dict(bad)
    assert len(tracker) == 2 and tracker.compute() == pytest.approx(2.5)


def test_meta_values_and_huge_counts_are_refused_up_front() -> None:
    tracker = LossTracker()
    with pytest.raises(ValueError, match="meta tensor"):
        tracker.update(torch.empty((), device="meta"))
    with pytest.raises(ValueError, match=r"n=1000"):
        tracker.update(1.0, n=10**400)
    assert len(tracker) == 0
