"""tune_loader: the same batches in the same order, the RNG streams untouched, a report that says why, and a
step that would train refused. Every tune_loader here reads a clock that counts batches (:class:`_Clock`):
a budget is work, and no test depends on the machine's speed."""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from speedups import (
    LoaderReport,
    SpeedupsError,
    SpeedupsWarning,
    accumulate,
    fast_loader,
    mixed_precision,
    tune_loader,
)
from tests._bench import run_quick
from tests._loading_data import Squares, Stream, record_init

FORK = "fork" in torch.multiprocessing.get_all_start_methods()
needs_fork = pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")


class _Clock:
    """tune_loader's clock in these tests: 0.05 s more at each read (a timed batch reads it twice: 0.1 s),
    plus what the test charges with :meth:`charge` in this process (a forked worker charges its own copy,
    which the loop never reads: loading in workers overlaps the step). A budget is then a number of batches,
    whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 0.05
        return self.now

    def charge(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def counting_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """:class:`_Clock` for speedups.data.tuning and speedups.data.timing (the only clock they read), in
    every test of this file: each tune_loader here times a number of batches, never a span of wall time."""
    from speedups.data import timing, tuning

    clock = _Clock()
    monkeypatch.setattr(tuning, "time", clock)
    monkeypatch.setattr(timing, "time", clock)
    return clock


# ------------------------------------------------------------------------------------------ A6 and pickling
def test_torch_refuses_a_multiprocessing_context_without_workers() -> None:
    """The case's loader needs num_workers > 0 to carry a multiprocessing_context; the tests use 2."""
    with pytest.raises(ValueError, match="multiprocessing_context"):
        DataLoader(list(range(8)), batch_size=2, collate_fn=lambda b: b, multiprocessing_context="spawn")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_collate_stays_at_zero_workers_with_one_warning(method: str) -> None:
    loader = DataLoader(
        list(range(8)), batch_size=2, collate_fn=lambda b: b, num_workers=2, multiprocessing_context=method
    )
    with pytest.warns(SpeedupsWarning, match=r"collate_fn=<function .*lambda.*staying at 0 workers") as rec:
        tuned, report = tune_loader(loader, max_seconds=1)
    assert len([w for w in rec if issubclass(w.category, SpeedupsWarning)]) == 1
    assert list(tuned) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tuned.num_workers == 0 and tuned.multiprocessing_context is None
    assert report.trials and all(t.num_workers == 0 for t in report.trials)
    assert "cannot be pickled" in report.reason


@pytest.mark.slow
def test_picklable_code_under_forkserver_may_get_workers() -> None:
    loader = DataLoader(Squares(64), batch_size=8, num_workers=1, multiprocessing_context="forkserver")
    tuned, report = tune_loader(
        loader, max_seconds=4, candidates=[{"num_workers": 0}, {"num_workers": 1}], progress=False
    )
    one = [t for t in report.trials if t.num_workers == 1]
    assert one and one[0].batches > 0  # a forkserver worker really ran
    assert "pickled" not in report.reason
    assert [b.tolist() for b in tuned] == [b.tolist() for b in DataLoader(Squares(64), batch_size=8)]


# ------------------------------------------------------------------------------- same batches, same streams
def _global_rng() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _assert_same_rng(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]


class NoisySquares(Squares):
    """Draws from the global RNGs in __getitem__ (as augmentation does) but returns deterministic data."""

    def __getitem__(self, i: int) -> torch.Tensor:
        torch.rand(()), np.random.rand(), random.random()
        return super().__getitem__(i)


def _make(kind: str, generator: torch.Generator) -> DataLoader:
    ds = NoisySquares(23)
    if kind == "shuffle":
        return DataLoader(ds, batch_size=4, shuffle=True, generator=generator, drop_last=True)
    if kind == "batch_sampler":
        sampler = BatchSampler(RandomSampler(ds, generator=generator), batch_size=5, drop_last=False)
        return DataLoader(ds, batch_sampler=sampler)
    if kind == "no_batching":
        return DataLoader(ds, batch_size=None, shuffle=True, generator=generator)
    return DataLoader(ds, batch_size=4)  # sequential


def _three_epochs(loader: DataLoader, g: torch.Generator) -> list[list[float]]:
    torch.manual_seed(9)
    g.manual_seed(5)
    return [b.tolist() for _ in range(3) for b in loader]


@pytest.mark.parametrize("kind", ["shuffle", "batch_sampler", "no_batching", "sequential"])
def test_tuned_loader_yields_the_same_batches_in_the_same_order(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    loader = _make(kind, g)
    g.manual_seed(5)
    g_state, rng = g.get_state(), _global_rng()
    candidates = [{"num_workers": 0}, {"num_workers": 2, "prefetch_factor": 3}] if FORK else None
    tuned, report = tune_loader(loader, max_seconds=1.5, candidates=candidates, progress=False)
    assert torch.equal(g.get_state(), g_state)  # timing did not consume the user's generator
    _assert_same_rng(rng, _global_rng())  # nor the global RNGs, though __getitem__ draws from them
    assert isinstance(report, LoaderReport) and len(report.trials) >= 1
    variants = [tuned]
    for workers in [0, 2] if FORK else [0]:  # every worker count, not only the fastest
        variant, other = tune_loader(
            loader, max_seconds=0.2, candidates=[{"num_workers": workers}], progress=False
        )
        assert other.chosen["num_workers"] == workers
        variants.append(variant)
    expected = _three_epochs(loader, g)
    for variant in variants:
        assert _three_epochs(variant, g) == expected, variant.num_workers
    assert tuned.batch_size == loader.batch_size and tuned.drop_last == loader.drop_last
    assert tuned.collate_fn is loader.collate_fn and tuned.generator is loader.generator


@needs_fork
def test_persistent_loader_is_not_tuned_down_to_zero_workers_and_keeps_its_order() -> None:
    loader = fast_loader(
        Squares(23),
        4,
        shuffle=True,
        num_workers=2,
        seed=0,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    tuned, report = tune_loader(loader, max_seconds=1.5, progress=False)
    assert all(t.num_workers > 0 for t in report.trials) and "0 workers was not timed" in report.reason
    assert tuned.persistent_workers and tuned.num_workers > 0
    g = loader.generator
    assert _three_epochs(tuned, g) == _three_epochs(loader, g)
    # the reason for the rule: a non-persistent loader would shuffle epochs 2 and 3 differently
    plain = DataLoader(Squares(23), 4, shuffle=True, num_workers=0, generator=g)
    assert _three_epochs(plain, g)[6:] != _three_epochs(loader, g)[6:]


def test_tuned_loader_keeps_timeout_context_and_init_fn() -> None:
    if not FORK:
        pytest.skip("needs fork")
    loader = DataLoader(
        Squares(16), 4, num_workers=1, timeout=30, worker_init_fn=record_init, multiprocessing_context="fork"
    )
    tuned, report = tune_loader(loader, max_seconds=1, candidates=[{"num_workers": 1}], progress=False)
    assert tuned.num_workers == 1 and tuned.persistent_workers and tuned.prefetch_factor == 2
    assert tuned.timeout == 30 and tuned.worker_init_fn is record_init
    assert tuned.multiprocessing_context is loader.multiprocessing_context
    assert report.chosen == {
        "num_workers": 1,
        "pin_memory": False,
        "prefetch_factor": 2,
        "persistent_workers": True,  # persisting exactly: what a fresh worker draws, every epoch
        "num_threads": torch.get_num_threads(),  # without a step, left as they are
    }


def test_report_prints_a_table_with_the_choice_and_why() -> None:
    loader = DataLoader(Squares(32), batch_size=4)
    _, report = tune_loader(loader, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    text = str(report)
    assert "num_workers" in text and "batches/s" in text and "<- chosen" in text
    assert "why: the only setting timed." in text
    # 0.1 s a batch on the test's clock: 10 batches, the rate over the later two thirds of them
    assert report.trials[0].batches_per_s == pytest.approx(10.0) and 1 <= report.seconds <= 1.3
    assert f"1 setting(s) timed in {report.seconds:.1f} s" in text


def test_choice_prefers_fewer_workers_within_five_percent() -> None:
    from speedups.data.timing import LoaderTrial
    from speedups.data.tuning import _choose

    trials = [LoaderTrial(0, False, None, 10.0, 9, 1), LoaderTrial(2, False, 2, 30.0, 9, 1)]
    trials += [LoaderTrial(4, False, 2, 31.0, 9, 1)]
    (workers, _, prefetch, _), reason = _choose(trials)
    assert (workers, prefetch) == (2, 2) and "within 5%" in reason
    (workers, _, _, _), reason = _choose([*trials, LoaderTrial(8, False, 2, 40.0, 9, 1)])
    assert workers == 8 and reason.startswith("fastest")


def test_progress_bar_appears_only_after_a_second() -> None:
    from speedups.data.tuning import _progress

    bar = _progress(3, True)
    try:
        assert bar is not None and bar.delay == 1.0 and bar.total == 3
    finally:
        bar.close()
    assert _progress(3, False) is None


def test_default_grid_stays_within_max_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the test's clock (0.1 s a batch): the budget is kept to the batch, worker start-up aside."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # grid: 0 and 1 worker
    loader = DataLoader(Squares(64), batch_size=8)
    _, report = tune_loader(loader, max_seconds=2, progress=False)
    assert {t.num_workers for t in report.trials} <= {0, 1}
    assert report.seconds <= 2 + 0.5  # a trial started before the deadline ends at its share or 4 batches


def test_a_trial_past_the_budget_is_the_last_and_the_report_says_what_was_not_timed(
    counting_clock: _Clock,
) -> None:
    """Batches that cost 1 s each (on the test's clock) and a 2 s budget: a trial reads at least 4 batches
    (a warm-up and 3 timed), so the first runs over, and the second setting is never started."""
    loader = DataLoader(_ChargedItems(counting_clock, 1.0), batch_size=1)
    candidates = [{"num_workers": 0}, {"num_workers": 1}]
    _, report = tune_loader(loader, max_seconds=2, candidates=candidates, progress=False)
    assert [t.num_workers for t in report.trials] == [0]
    assert "the time budget ran out before 1 setting(s) could be timed" in report.reason
    assert 4 <= report.seconds <= 5


def test_iterable_dataset_keeps_its_workers_and_says_so() -> None:
    loader = DataLoader(Stream(10), batch_size=3)
    with pytest.warns(SpeedupsWarning, match="num_workers is kept at 0"):
        tuned, report = tune_loader(loader, max_seconds=1, progress=False)
    assert tuned.num_workers == 0 and all(t.num_workers == 0 for t in report.trials)
    assert [b.tolist() for b in tuned] == [b.tolist() for b in loader]
    assert "IterableDataset" in report.reason


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_seconds": 0}, ValueError, r"tune_loader\(max_seconds=0.*positive"),
        ({"max_seconds": -1}, ValueError, "positive"),
        ({"max_seconds": math.nan}, ValueError, "finite"),
        ({"max_seconds": "10"}, TypeError, "max_seconds='10': expected a positive finite number"),
        ({"candidates": []}, TypeError, "non-empty list"),
        ({"candidates": [{"workers": 2}]}, ValueError, "each candidate"),
        ({"candidates": [{"num_workers": -1}]}, ValueError, ">= 0"),
        ({"candidates": [{"num_workers": 0, "prefetch_factor": 2}]}, ValueError, "prefetch_factor"),
        ({"step": "train"}, TypeError, r"step='train': expected a function of one batch"),
    ],
)
def test_tune_loader_bad_input(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        tune_loader(DataLoader(list(range(4))), **kwargs)


def _two_ids(worker_id: int, other: int) -> None:
    pass


def test_tune_loader_refuses_a_worker_init_fn_no_worker_can_call_before_timing() -> None:
    """A loader without workers never calls it; tune_loader would, inside a timed worker, mid-tuning."""
    loader = DataLoader(list(range(8)), batch_size=2, worker_init_fn=_two_ids)
    with pytest.raises(
        TypeError,
        match=r"tune_loader\(max_seconds=1, candidates=None\): loader\.worker_init_fn=<function _two_ids.*"
        r"missing a required argument: 'other'.*worker_init_fn=functools\.partial\(_two_ids, \.\.\.\)",
    ):
        tune_loader(loader, max_seconds=1)


def test_tune_loader_rejects_a_non_loader() -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.utils\.data\.DataLoader"):
        tune_loader(TensorDataset(torch.zeros(3)))  # type: ignore[arg-type]


@pytest.mark.slow
def test_benchmark_quick_mode_prints_its_table() -> None:
    stdout = run_quick("loading", timeout=240)
    assert "num_workers=0" in stdout and "tune_loader" in stdout and "batches/s" in stdout


def test_tune_loader_refuses_a_subclass_it_would_flatten() -> None:
    from speedups import distributed

    loader = distributed(DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4, shuffle=True), rank=0,
                         world_size=2)  # fmt: skip
    with pytest.raises(TypeError, match=r"distributed\(tune_loader\(loader\)\[0\]\)"):
        tune_loader(loader, max_seconds=1)
    epochs = [[b[0].tolist() for b in loader] for _ in range(2)]
    assert epochs[0] != epochs[1]  # the loader still advances its epoch


def test_tune_loader_checks_its_progress_flag() -> None:
    with pytest.raises(TypeError, match=r"progress='no'"):
        tune_loader(DataLoader(list(range(4)), batch_size=2), progress="no")


# ------------------------------------------------------------------------------- pinning, with the GPU copy
@pytest.fixture
def gpu_copies(monkeypatch, counting_clock: _Clock):
    """CUDA stood in: each batch's copy to the GPU costs what it would (a blocking copy from pageable memory,
    nothing on the host from pinned memory: 0.04 s against none per 0.1 s batch, on the test's clock).
    Returns each copy's pinned flag."""
    from speedups.data import timing, tuning

    copies: list[bool] = []

    def copy_batch(batch, device, pinned: bool):
        copies.append(pinned)
        counting_clock.charge(0.0 if pinned else 0.04)
        return batch

    monkeypatch.setattr(tuning, "_copy_target", lambda: torch.device("meta"))
    monkeypatch.setattr(timing, "copy_batch", copy_batch)
    return copies


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # no accelerator here to pin for
def test_with_the_gpu_copy_timed_pinning_is_kept_where_it_saves_the_copy(gpu_copies) -> None:
    copies = gpu_copies
    loader = DataLoader(list(range(64)), batch_size=8, pin_memory=False)
    candidates = [{"num_workers": 0, "pin_memory": False}, {"num_workers": 0, "pin_memory": True}]
    tuned, report = tune_loader(loader, max_seconds=1, candidates=candidates, progress=False)
    assert set(copies) == {True, False}  # every setting was timed with its copies
    assert report.chosen["pin_memory"] is True and tuned.pin_memory is True


def test_a_tie_keeps_the_loaders_own_pinning() -> None:
    """Flipping pin_memory within 5% of the fastest did not measurably help: the loader's setting stays."""
    from speedups.data.timing import LoaderTrial
    from speedups.data.tuning import _choose

    trials = [LoaderTrial(2, False, 2, 100.0, 50, 1.0), LoaderTrial(2, True, 2, 98.0, 49, 1.0)]
    for own in (False, True):
        assert _choose(trials, keep_pin=own)[0] == (2, own, 2, None)
    trials[1] = LoaderTrial(2, True, 2, 130.0, 65, 1.0)  # pinning helps: it wins whatever the loader had
    assert _choose(trials, keep_pin=False)[0] == (2, True, 2, None)


# ------------------------------------------------------------- tune_loader(step=): the loop's own contention
BOTH = [{"num_workers": 0}, {"num_workers": 2}]


@pytest.fixture
def one_thread():
    """One intra-op thread; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(matmuls: int, seen: list):
    """A synthetic training step: ``matmuls`` 384x384 products on every core (under a millisecond each)."""
    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))

    def step(batch: torch.Tensor) -> None:
        seen.append(batch)
        for _ in range(matmuls):
            a @ a

    return step


@needs_fork
def test_the_step_runs_on_every_timed_batch_of_every_setting(one_thread) -> None:
    """Which setting wins where loading is cheap is the machine's answer (a loaded machine flipped it: 245
    batches/s with 2 workers against 149 without); what is ours is that every setting is timed with the
    step on the loop's batches. The choice's logic: the fake-clock tests. The clock counts its reads, so
    the 6 s budget is about 60 batches however slow the machine (on the wall clock, a loaded machine spent
    20 s on the first setting and the test failed)."""
    seen: list = []
    cheap = DataLoader(TensorDataset(torch.arange(80_000.0).reshape(-1, 4)), batch_size=8)
    _, report = tune_loader(
        cheap, candidates=BOTH, step=_step(1, seen), max_seconds=6, progress=False, num_threads=None
    )
    assert {t.num_workers for t in report.trials if t.batches > 0} == {0, 2}, str(report)
    assert report.measured == "loading with the training step"
    assert "measured: loading with the training step" in str(report)
    assert 4 * 4 <= len(seen) <= 6 / 0.1 + 4 * 6  # 4 trials of >= 4 batches; the budget and 4 warm-ups
    assert all(len(b) == 1 and b[0].shape == (8, 4) for b in seen)  # the loop's batches


class _ChargedItems(torch.utils.data.Dataset):
    """Items that cost ``seconds`` each on the test's clock of the process that loads them: in the loop's
    process with 0 workers, in a worker's copy of the clock (overlapping the step) with workers."""

    def __init__(self, clock: _Clock, seconds: float, n: int = 100_000) -> None:
        self.clock, self.seconds, self.n = clock, seconds, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.charge(self.seconds)
        return torch.full((4,), float(i))


@needs_fork
def test_where_loading_dominates_the_step_two_workers_are_chosen(counting_clock: _Clock) -> None:
    """Batches that cost 0.08 s to load in the loop's process beside a 0.1 s step: with workers the loading
    overlaps the step (0.1 s a batch against 0.18 s), so 2 workers win by the rates measured, on a clock that
    counts the work, not the machine's speed."""
    slow_items = DataLoader(_ChargedItems(counting_clock, 0.01), batch_size=8)
    _, report = tune_loader(
        slow_items, candidates=BOTH, step=_step(1, []), max_seconds=3, progress=False, num_threads=None
    )
    assert report.chosen["num_workers"] == 2, str(report)
    rates = {t.num_workers: t.batches_per_s for t in report.trials}
    assert rates[0] == pytest.approx(1 / 0.18) and rates[2] == pytest.approx(1 / 0.1), str(report)
    assert report.measured == "loading with the training step"
    _, alone = tune_loader(DataLoader(list(range(8))), candidates=BOTH[:1], max_seconds=1, progress=False)
    assert alone.measured == "loading alone" and "measured: loading alone" in str(alone)


# ------------------------------------------------------------- compute threads: the cores split with loading
@pytest.fixture
def threads_kept():
    """tune_loader(step=...) sets torch's thread count on purpose: put the test's back after."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _fake_timing(
    monkeypatch: pytest.MonkeyPatch, rates: dict[tuple[int, int], float]
) -> list[tuple[int, int]]:
    """Replace the timing: each (num_workers, num_threads) trial gets the rate of ``rates``; returns the
    trials run, in order. No timing in these tests: only the choice's logic (the budget is read on
    :class:`_Clock`, 0.05 s a read: no deadline is reached, however slow the machine)."""
    from speedups.data import tuning
    from speedups.data.timing import LoaderTrial

    ran: list[tuple[int, int]] = []

    def fake(loader, sampling, setting, share, generator, device=None, step=None, num_threads=None):
        workers, pin, prefetch = setting
        threads = torch.get_num_threads() if num_threads is None else num_threads
        ran.append((workers, threads))
        return LoaderTrial(workers, pin, prefetch, rates.get((workers, threads), 1.0), 20, 0.01, threads)

    monkeypatch.setattr(tuning, "time_setting", fake)
    return ran


def _two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.set_num_threads(2)  # torch's default on 2 cores


def test_split_cores_gives_compute_what_the_workers_leave_never_more_than_before() -> None:
    from speedups.data.tuning import split_cores

    assert [split_cores(2, w, 2) for w in (0, 1, 2, 3)] == [2, 1, 1, 1]
    assert [split_cores(8, w, 8) for w in (0, 2, 4, 8)] == [8, 6, 4, 1]
    assert split_cores(8, 2, 4) == 4  # a count the user lowered is an upper bound


@pytest.mark.parametrize(
    ("rates", "threads"),
    [
        ({(0, 2): 40.0, (0, 1): 100.0, (1, 1): 90.0}, 1),  # a busy core beside: 2 threads wait on each other
        ({(0, 2): 100.0, (0, 1): 60.0, (1, 1): 80.0}, 2),  # a quiet machine, a step that scales
        ({(0, 2): 100.0, (0, 1): 97.0, (1, 1): 50.0}, 1),  # within 5%: fewer threads
    ],
    ids=["busy", "quiet", "tie"],
)
def test_with_a_step_two_cores_are_split_between_threads_and_workers(
    monkeypatch: pytest.MonkeyPatch, threads_kept, rates: dict, threads: int
) -> None:
    _two_cores(monkeypatch)
    ran = _fake_timing(monkeypatch, rates)
    loader = DataLoader(Squares(64), batch_size=8)
    candidates = [{"num_workers": 0}, {"num_workers": 1}]
    _, report = tune_loader(loader, candidates=candidates, step=lambda b: None, max_seconds=5, progress=False)
    # first the step's threads at 0 workers (all, half as many = 1), twice round-robin; then 1 worker with
    # the single core it leaves
    assert ran == [(0, 2), (0, 1), (0, 2), (0, 1), (1, 1), (1, 1)]
    assert report.chosen["num_threads"] == threads == torch.get_num_threads()  # set for the training
    assert report.chosen["num_workers"] == 0 and report.num_threads_before == 2
    if threads != 2:
        assert f"compute threads: {threads} (torch.set_num_threads({threads}); it was 2)" in report.reason
    assert "threads" in str(report) and str(report).count("<- chosen") == 1


def test_the_plan_never_gets_more_threads_than_the_step_was_fastest_with(monkeypatch, threads_kept) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    torch.set_num_threads(8)
    ran = _fake_timing(monkeypatch, {(0, 8): 10.0, (0, 4): 50.0, (0, 1): 20.0, (2, 4): 60.0, (4, 4): 55.0})
    candidates = [{"num_workers": w} for w in (0, 2, 4, 6)]
    _, report = tune_loader(
        DataLoader(Squares(64), batch_size=8), candidates=candidates, step=lambda b: None, progress=False
    )
    assert ran[:6] == [(0, 8), (0, 4), (0, 1)] * 2
    assert sorted(set(ran[6:])) == [(2, 4), (4, 4), (6, 2)]  # min(4, 8 - workers)
    assert (
        (report.chosen["num_workers"], report.chosen["num_threads"]) == (2, 4) == (2, torch.get_num_threads())
    )


def test_the_users_thread_settings_are_respected(monkeypatch: pytest.MonkeyPatch, threads_kept) -> None:
    from speedups.kernels.reproducible import deterministic

    _two_cores(monkeypatch)
    ran = _fake_timing(monkeypatch, {(0, 2): 10.0, (0, 1): 100.0})
    loader, step = DataLoader(Squares(64), batch_size=8), (lambda b: None)
    zero = [{"num_workers": 0}]
    # None: left alone, whatever the rates
    _, report = tune_loader(loader, candidates=zero, step=step, num_threads=None, progress=False)
    assert set(ran) == {(0, 2)} and torch.get_num_threads() == 2 == report.chosen["num_threads"]
    # an int: every trial with it, and set
    ran.clear()
    _, report = tune_loader(loader, candidates=zero, step=step, num_threads=1, progress=False)
    assert set(ran) == {(0, 1)} and torch.get_num_threads() == 1 == report.chosen["num_threads"]
    assert "num_threads=1" in report.reason
    torch.set_num_threads(2)
    # OMP_NUM_THREADS in the environment: the user's count, kept
    ran.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _, report = tune_loader(loader, candidates=zero, step=step, progress=False)
    assert set(ran) == {(0, 2)} and torch.get_num_threads() == 2
    assert "compute threads kept at 2: OMP_NUM_THREADS is set" in report.reason
    monkeypatch.delenv("OMP_NUM_THREADS")
    # deterministic algorithms: the thread count changes float rounding, so it is not chosen by a clock
    ran.clear()
    with deterministic(seed=None):
        _, report = tune_loader(loader, candidates=zero, step=step, progress=False)
    assert set(ran) == {(0, 2)} and "deterministic algorithms are on" in report.reason
    # without a step there is nothing to time them with
    ran.clear()
    _, report = tune_loader(loader, candidates=zero, progress=False)
    assert set(ran) == {(0, 2)} and torch.get_num_threads() == 2 and "thread" not in report.reason


def test_a_real_trial_runs_the_step_with_the_threads_asked_and_puts_them_back(threads_kept) -> None:
    seen: list[int] = []
    loader = DataLoader(Squares(16), batch_size=4)
    torch.set_num_threads(2)
    _, report = tune_loader(
        loader, candidates=[{"num_workers": 0}], step=lambda b: seen.append(torch.get_num_threads()),
        num_threads=1, max_seconds=0.5, progress=False,
    )  # fmt: skip
    assert set(seen) == {1} and report.trials[0].num_threads == 1 and report.num_threads_before == 2


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"tune_loader\(.*num_threads=0\): num_threads=0: must be an int >= 1 or None"),
        ("many", TypeError, r"num_threads='many': expected an int >= 1 or None.*'auto'"),
        (2.0, TypeError, r"num_threads=2\.0: expected an int"),
        (True, TypeError, r"num_threads=True: expected an int"),
    ],
)
def test_bad_num_threads_is_refused_before_anything_runs(value, error, match) -> None:
    with pytest.raises(error, match=match):
        tune_loader(DataLoader(list(range(4))), num_threads=value)


# ---------------------------------------------------------------- tune_loader(step=): the step must not train
def _regression() -> tuple[torch.nn.Module, DataLoader]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    return torch.nn.Linear(8, 1), DataLoader(data, batch_size=8)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list, dict]:
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}  # fmt: skip
    return weights, state


def _assert_unchanged(model: torch.nn.Module, opt: torch.optim.Optimizer, before: tuple[list, dict]) -> None:
    weights, state = before
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert len(opt.state) == len(state)
    for i, now in enumerate(opt.state.values()):
        assert now.keys() == state[i].keys()
        for key, value in now.items():
            same = (
                torch.equal(value, state[i][key])
                if isinstance(value, torch.Tensor)
                else value == state[i][key]
            )
            assert same, key


def _plain_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


_FIX = (
    r"The step given to tune_loader may run forward and backward, not an update: no optimizer\.step\(\), "
    r"scheduler\.step\(\) or scaler\.update\(\)\. Time the model's "
    r"work on a copy, without the update: probe = copy\.deepcopy\(model\); tune_loader\(loader, "
    r"step=lambda batch: loss_fn\(probe\(batch\[0\]\), batch\[1\]\)\.backward\(\)\)\.$"
)
_REFUSED_STEP = r"^tune_loader\(step=[^:]+\): {how} an @accumulate step: .*; nothing was run\. " + _FIX
_FORMS = ["the step", "under mixed_precision", "a lambda calling it", "a closure calling it", "a partial"]


@pytest.mark.parametrize("form", _FORMS)
def test_an_accumulate_step_is_refused_before_anything_runs(form: str) -> None:
    """nc13: tune_loader(step=train_step) with the @accumulate step took 7,573 optimizer steps on the real
    model in 2 s, silently. Refused, with the fix, before one call: weights, optimizer state, the step's
    counters and the user's function untouched."""
    model, loader = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _plain_steps(model, opt, list(loader)[:2])  # momentum buffers exist
    before = _snapshot(model, opt)
    calls: list[int] = []

    @accumulate(1, opt)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.mse_loss(model(x), y)

    def closure_step(batch: list) -> object:
        return train_step(*batch)

    step = {
        "the step": train_step,
        "under mixed_precision": mixed_precision("bf16", device_type="cpu")(train_step),
        "a lambda calling it": lambda batch: train_step(*batch),
        "a closure calling it": closure_step,
        "a partial": functools.partial(train_step),
    }[form]
    how = {
        "the step": "train_step is",
        "under mixed_precision": "it wraps train_step,",
        "a partial": "it wraps train_step,",
    }.get(form, "it calls train_step,")
    with pytest.raises(SpeedupsError, match=_REFUSED_STEP.format(how=how)):
        tune_loader(loader, step=step, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    assert calls == [] and train_step.step == 0 and train_step.num_updates == 0
    _assert_unchanged(model, opt, before)


_UPDATING = [
    ("SGD", {"momentum": 0.9}),
    ("Adam", {"fused": True}),
    ("AdamW", {"foreach": True}),
]


@pytest.mark.parametrize(("name", "options"), _UPDATING, ids=[f"{n}-{o}" for n, o in _UPDATING])
@pytest.mark.parametrize("catches", [False, True], ids=["raises", "step catches the error"])
def test_a_step_that_steps_an_optimizer_is_refused_before_the_optimizer_changes_anything(
    name: str, options: dict, catches: bool
) -> None:
    """Any step that steps a torch.optim.Optimizer is stopped at its first optimizer step, before it: the
    weights and the optimizer state are bitwise as before, and the run then continues as the plain loop
    that never called tune_loader (the hook is gone). A step that swallows the error is refused when it
    returns."""
    model, loader = _regression()
    batches = list(loader)
    reference = copy.deepcopy(model)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **options)
    ref_opt = getattr(torch.optim, name)(reference.parameters(), lr=0.01, **options)
    _plain_steps(model, opt, batches[:2])
    _plain_steps(reference, ref_opt, batches[:2])
    before = _snapshot(model, opt)
    calls: list[int] = []

    def step(batch: list) -> None:
        calls.append(1)
        opt.zero_grad()
        F.mse_loss(model(batch[0]), batch[1]).backward()
        try:
            opt.step()
        except SpeedupsError:
            if not catches:
                raise

    refused = (
        rf"^tune_loader\(step=step\): the step called {name}\.step\(\) on timed batch 1: .*; refused before "
        r"that optimizer changed anything \(the weights and its state are as they were, .*\)\. " + _FIX
    )
    with pytest.raises(SpeedupsError, match=refused):
        tune_loader(loader, step=step, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    assert calls == [1]  # stopped at the first call
    _assert_unchanged(model, opt, before)
    _plain_steps(model, opt, batches[2:5])  # the optimizer steps again outside tune_loader
    _plain_steps(reference, ref_opt, batches[2:5])
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_step_without_an_update_is_timed_and_other_threads_optimizers_are_left_alone() -> None:
    """What the message asks for runs: forward and backward on a copy (scaled by the run's GradScaler, as
    the loop does), the real model, its scheduler and scaler as they were. An optimizer stepping in another
    thread while tune_loader runs is not the step's and is not refused."""
    model, loader = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    before, state = _snapshot(model, opt), _training_state(opt, sched, scaler)
    probe = copy.deepcopy(model)
    calls: list[int] = []

    def work(batch: list) -> None:
        calls.append(1)
        scaler.scale(F.mse_loss(probe(batch[0]), batch[1])).backward()
        if len(calls) == 1:  # another thread's training, during the timing
            other = torch.nn.Linear(2, 1)
            other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
            other(torch.ones(1, 2)).sum().backward()
            w = other.weight.detach().clone()
            thread = threading.Thread(target=other_opt.step)
            thread.start()
            thread.join()
            assert not torch.equal(other.weight, w)

    only_zero = [{"num_workers": 0}]
    _, report = tune_loader(
        loader, step=work, candidates=only_zero, max_seconds=0.2, progress=False, num_threads=None
    )
    assert calls and report.trials[0].batches > 0
    _assert_unchanged(model, opt, before)
    _assert_same_state(_training_state(opt, sched, scaler), state)


# ------------------------------------------ tune_loader(step=): schedulers, hyperparameters and scalers
def _scheduled(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, DataLoader]:
    """A model, its optimizer and a scheduler of ``kind`` (None: no scheduler)."""
    model, loader = _regression()
    if kind == "CosineAnnealingLR, tensor lr":  # a tensor lr: the scheduler fills it in place
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lr = torch.optim.lr_scheduler
    make = {
        "StepLR": lambda: lr.StepLR(opt, step_size=2, gamma=0.5),
        "OneCycleLR": lambda: lr.OneCycleLR(opt, max_lr=0.2, total_steps=100),  # lr and momentum move
        "LambdaLR": lambda: lr.LambdaLR(opt, lambda epoch: 0.9**epoch),
        "SequentialLR": lambda: lr.SequentialLR(
            opt, [lr.LinearLR(opt, 0.5, total_iters=3), lr.ExponentialLR(opt, 0.9)], milestones=[3]
        ),
        "ReduceLROnPlateau": lambda: lr.ReduceLROnPlateau(opt, patience=0),
        "CosineAnnealingLR, tensor lr": lambda: lr.CosineAnnealingLR(opt, T_max=10),
        "none": lambda: None,
    }
    return model, opt, make[kind](), loader


def _step_schedule(sched: object, loss: torch.Tensor) -> None:
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(loss.item())
    elif sched is not None:
        sched.step()  # type: ignore[attr-defined]


def _scheduled_steps(model, opt, sched, batches: list, scaler=None) -> list[float]:
    """The plain loop with a schedule (and a GradScaler): the reference the tests below end on. Returns the
    lr after each step."""
    lrs = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        _step_schedule(sched, loss)
        lrs.append(float(opt.param_groups[0]["lr"]))
    return lrs


def _training_state(opt, sched=None, scaler=None) -> tuple:
    """What an update moves besides the weights: each group's values (tensors cloned), the scheduler's and
    the scaler's state_dict."""
    groups = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
              for g in opt.param_groups]  # fmt: skip
    return (
        groups,
        None if sched is None else copy.deepcopy(sched.state_dict()),
        None if scaler is None else scaler.state_dict(),
    )


def _assert_same_state(now: tuple, before: tuple) -> None:
    """Bitwise: tensors by dtype and values, everything else by ==, element by element."""

    def same(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))  # type: ignore[arg-type]
        return a == b

    assert same(now, before), (now, before)


def _assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)


_KINDS = [
    "StepLR",
    "OneCycleLR",
    "LambdaLR",
    "SequentialLR",
    "ReduceLROnPlateau",
    "CosineAnnealingLR, tensor lr",
]
_MOVED = (
    r"^tune_loader\(step=step\): the step moved the training state by timed batch {n}: (?=.*{what}).*\. "
    r"Run on every timed batch \(thousands\), it would move it before training starts \(.*\); it is put "
    r"back exactly as it was before tuning\. The step given to tune_loader may run forward and backward, "
    r"not an update: no optimizer\.step\(\), scheduler\.step\(\) or scaler\.update\(\)\. Time the model's "
    r"work on a copy"
)
_ONE = {"candidates": [{"num_workers": 0}], "progress": False, "num_threads": None}


@pytest.mark.parametrize("kind", _KINDS)
def test_a_step_that_steps_a_scheduler_is_refused_and_the_schedule_put_back_exactly(kind: str) -> None:
    """The trial's field case: 'the loop body minus optimizer.step()' still called sched.step(); 1 s of
    tuning left StepLR(step_size=100, gamma=0.5) at last_epoch 4144 and lr 4.5e-14, silently. Refused after
    the first timed call, the scheduler's state_dict and every param_group value bitwise as before (a tensor
    lr the same tensor), and training then follows the plain loop that never called tune_loader."""
    model, opt, sched, loader = _scheduled(kind)
    reference, ref_opt, ref_sched, _ = _scheduled(kind)
    batches = list(loader)
    _scheduled_steps(model, opt, sched, batches[:3])  # mid-schedule
    _scheduled_steps(reference, ref_opt, ref_sched, batches[:3])
    before, lr_object = _training_state(opt, sched), opt.param_groups[0]["lr"]
    probe = copy.deepcopy(model)

    def step(batch: list) -> None:
        loss = F.mse_loss(probe(batch[0]), batch[1])
        loss.backward()
        _step_schedule(sched, loss + 1)  # ReduceLROnPlateau: a worse loss, every time

    what = (
        "ReduceLROnPlateau: " if kind == "ReduceLROnPlateau" else rf"{kind.split(',')[0]}: last_epoch 3 -> 4"
    )
    with pytest.raises(SpeedupsError, match=_MOVED.format(n=1, what=what)):
        tune_loader(loader, step=step, max_seconds=1, **_ONE)
    _assert_same_state(_training_state(opt, sched), before)
    assert opt.param_groups[0]["lr"] is lr_object
    lrs = _scheduled_steps(model, opt, sched, batches[3:7])
    assert lrs == _scheduled_steps(reference, ref_opt, ref_sched, batches[3:7])
    _assert_same_weights(model, reference)
    _assert_same_state(_training_state(opt, sched), _training_state(ref_opt, ref_sched))


_BY_HAND = {
    "lr set": lambda opt, extra: opt.param_groups[0].__setitem__("lr", opt.param_groups[0]["lr"] * 0.5),
    "tensor lr in place": lambda opt, extra: opt.param_groups[0]["lr"].mul_(0.5),
    "betas": lambda opt, extra: opt.param_groups[0].__setitem__("betas", (0.8, 0.99)),
    "weight_decay": lambda opt, extra: opt.param_groups[0].__setitem__("weight_decay", 0.1),
    "a key added": lambda opt, extra: opt.param_groups[0].__setitem__("warmup", 1),
    "a group added": lambda opt, extra: opt.add_param_group({"params": [extra]}),
}


@pytest.mark.parametrize("change", list(_BY_HAND))
def test_a_step_that_changes_hyperparameters_by_hand_is_refused_and_they_are_put_back(change: str) -> None:
    """A warm-up or schedule written by hand (param_groups edited in the step) is the same fault as a
    scheduler: refused after the first call, every group bitwise as before (a tensor lr the same tensor with
    its value back), and Adam then trains as the plain loop."""
    lr = torch.tensor(0.01) if change == "tensor lr in place" else 0.01
    model, loader = _regression()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=copy.deepcopy(lr))
    batches = list(loader)
    _scheduled_steps(model, opt, None, batches[:2])
    _scheduled_steps(reference, ref_opt, None, batches[:2])
    before, groups, lr_object = _training_state(opt), list(opt.param_groups), opt.param_groups[0]["lr"]
    probe, extra = copy.deepcopy(model), torch.nn.Parameter(torch.zeros(2))

    def step(batch: list) -> None:
        F.mse_loss(probe(batch[0]), batch[1]).backward()
        _BY_HAND[change](opt, extra)

    what = (
        r"Adam\.param_groups: 1 group\(s\) -> 2"
        if change == "a group added"
        else r"Adam\.param_groups\[0\]: "
    )
    with pytest.raises(SpeedupsError, match=_MOVED.format(n=1, what=what)):
        tune_loader(loader, step=step, max_seconds=1, **_ONE)
    _assert_same_state(_training_state(opt), before)
    assert opt.param_groups == groups and opt.param_groups[0]["lr"] is lr_object
    _scheduled_steps(model, opt, None, batches[2:5])
    _scheduled_steps(reference, ref_opt, None, batches[2:5])
    _assert_same_weights(model, reference)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # torch's, meant
def test_a_state_moved_after_the_first_call_is_refused_at_the_next_check_or_when_tuning_ends() -> None:
    """Compared after calls 1, 2, 4, 8, ... and at the end: a scheduler stepped from call 3 on is seen at
    call 4, one stepped at call 5 of 5 when tuning ends; both put back exactly."""
    model, opt, sched, loader = _scheduled("StepLR")
    before = _training_state(opt, sched)
    probe = copy.deepcopy(model)
    calls: list[int] = []

    def from_call(first: int, last: int):
        def step(batch: list) -> None:
            calls.append(1)
            F.mse_loss(probe(batch[0]), batch[1]).backward()
            if first <= len(calls) <= last:
                sched.step()

        return step

    with pytest.raises(SpeedupsError, match=_MOVED.format(n=4, what="StepLR: last_epoch 0 -> 2")):
        tune_loader(loader, step=from_call(3, 10**9), max_seconds=1, **_ONE)
    assert len(calls) == 4
    _assert_same_state(_training_state(opt, sched), before)
    calls.clear()
    with pytest.raises(SpeedupsError, match=_MOVED.format(n=5, what="StepLR: last_epoch 0 -> 1")):
        tune_loader(loader, step=from_call(5, 5), max_seconds=0.5, **_ONE)
    assert len(calls) == 5  # the budget's last call: no power of two checked it, the end did
    _assert_same_state(_training_state(opt, sched), before)


def _scaled(seed_scale: float = 2.0**10) -> tuple:
    """A model with SGD, a StepLR and an enabled CPU GradScaler, two plain scaled steps in, and its twin."""
    made = []
    for _ in range(2):
        model, opt, sched, loader = _scheduled("StepLR")
        scaler = torch.amp.GradScaler("cpu", init_scale=seed_scale, growth_interval=3)
        _scheduled_steps(model, opt, sched, list(loader)[:2], scaler)
        made.append((model, opt, sched, scaler))
    return (*made, loader)


@pytest.mark.parametrize("update", ["unscale_ and update", "scaler.step and update"])
def test_a_step_that_updates_a_grad_scaler_is_refused_and_the_scaler_trains_as_before(update: str) -> None:
    """'unscale_ and update': the step leaves the optimizer out but updates the scaler, moving its growth
    tracker (and at growth_interval its scale): refused after call 1, the scaler's state_dict put back.
    'scaler.step and update': the optimizer step inside scaler.step is refused, and the scaler's record of
    that iteration (unscaled, for that optimizer) is cleared: left there, the first real scaler.step skipped
    its unscaling and stepped on gradients 1,024 times too large (weights thousands off). Both then train
    bitwise as the plain loop with the same scaler, scheduler and optimizer."""
    (model, opt, sched, scaler), (reference, ref_opt, ref_sched, ref_scaler), loader = _scaled()
    before = _training_state(opt, sched, scaler)

    def step(batch: list) -> None:
        scaler.scale(F.mse_loss(model(batch[0]), batch[1])).backward()
        if update == "unscale_ and update":
            scaler.unscale_(opt)
        else:
            scaler.step(opt)
        scaler.update()

    if update == "unscale_ and update":
        refused = _MOVED.format(n=1, what="GradScaler: scale 1024.0 -> 2048.0, _growth_tracker 2 -> 0")
    else:
        refused = r"^tune_loader\(step=step\): the step called SGD\.step\(\) on timed batch 1: "
    with pytest.raises(SpeedupsError, match=refused):
        tune_loader(loader, step=step, max_seconds=1, **_ONE)
    _assert_same_state(_training_state(opt, sched, scaler), before)
    batches = list(loader)[2:6]
    lrs = _scheduled_steps(model, opt, sched, batches, scaler)
    assert lrs == _scheduled_steps(reference, ref_opt, ref_sched, batches, ref_scaler)
    _assert_same_weights(model, reference)
    _assert_same_state(_training_state(opt, sched, scaler), _training_state(ref_opt, ref_sched, ref_scaler))
