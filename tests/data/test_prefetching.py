"""prefetch_to_device: batches one step ahead, the loader's position the step's, against plain loops.

On the CPU a recording strategy stands in for the CUDA side stream: its "copy" is a deep copy, and it logs
when each batch's copy is started and waited for, so the order (batch i+1 started before batch i is handed
out) and the position a checkpoint records are checked here; the side stream itself runs under `-m cuda`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedups import RunDirectory, SpeedupsError, accumulate, distributed, load_checkpoint, save_checkpoint
from speedups.data.prefetching import DevicePrefetcher, PassThrough, SideStreamCopy, prefetch_to_device

N, BATCH = 10, 3  # 4 batches an epoch: 3, 3, 3, 1


class Recording:
    """The side stream's stand-in: ``start`` copies (deep copy) and logs ("copy", i), ``finish`` logs
    ("wait", i); ``i`` is the batch's first sample index."""

    ahead = 1

    def __init__(self, log: list[tuple[str, int]] | None = None) -> None:
        self.log = [] if log is None else log

    def start(self, batch: Any) -> tuple[int, Any]:
        self.log.append(("copy", _tag(batch)))
        return _tag(batch), copy.deepcopy(batch)

    def finish(self, handle: tuple[int, Any]) -> Any:
        self.log.append(("wait", handle[0]))
        return handle[1]


def _tag(batch: Any) -> int:
    return int(batch[0][0])


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.arange(N), torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g))


def _loader(batch: int = BATCH, **kwargs: Any) -> Any:
    return distributed(DataLoader(_data(), batch_size=batch, shuffle=True), seed=5, **kwargs)


def _same(got: list[Any], ref: list[Any]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_each_batch_is_copied_while_the_step_before_it_runs() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.tensor([i]), torch.randn(2, 3, generator=g)) for i in range(4)]
    log: list[tuple[str, int]] = []
    got = []
    for batch in DevicePrefetcher(batches, Recording(log)):
        log.append(("step", _tag(batch)))
        got.append(batch)
    _same(got, batches)  # the values of the plain list, in its order
    assert all(a[1] is not b[1] for a, b in zip(got, batches, strict=True))  # copies, as a device's are
    expected = [("copy", 0), ("copy", 1), ("wait", 0), ("step", 0)]
    for i in (1, 2):
        expected += [("copy", i + 1), ("wait", i), ("step", i)]
    expected += [("wait", 3), ("step", 3)]  # the last: nothing left to draw
    assert log == expected


def test_the_loaders_position_is_the_steps_at_every_batch_of_every_epoch() -> None:
    def run(wrap: bool) -> tuple[list[Any], list[tuple[int, int]]]:
        loader = _loader()
        source = DevicePrefetcher(loader, Recording()) if wrap else loader
        seen, positions = [], []
        for _ in range(2):
            for batch in source:
                seen.append(batch)
                state = loader.state_dict()
                positions.append((state["epoch"], state["batches"]))
            positions.append((loader.state_dict()["epoch"], loader.state_dict()["batches"]))
        return seen, positions

    seen, positions = run(wrap=True)
    ref_seen, ref_positions = run(wrap=False)  # the plain loop over the same loader
    _same(seen, ref_seen)
    assert positions == ref_positions
    assert positions[:5] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]  # the last batch is still epoch 0's


@pytest.mark.parametrize("stop", range(4))
def test_a_break_with_a_batch_in_flight_loses_and_repeats_nothing(stop: int) -> None:
    ref = list(_loader())  # the plain epoch
    loader = _loader()
    log: list[tuple[str, int]] = []
    seen = []
    for i, batch in enumerate(DevicePrefetcher(loader, Recording(log))):
        seen.append(batch)
        if i == stop:
            break
    if stop < 3:  # the next batch was drawn and its copy started, and never handed out
        assert log[-1] == ("wait", _tag(ref[stop])) and ("copy", _tag(ref[stop + 1])) in log
    saved = loader.state_dict()
    assert saved["batches"] == (stop + 1 if stop < 3 else 4)
    resumed = _loader()
    resumed.load_state_dict(saved)
    _same(seen + list(DevicePrefetcher(resumed, Recording())), ref)


def test_iterating_again_starts_the_next_epoch_and_len_and_set_epoch_pass_through() -> None:
    loader, ref = _loader(), _loader()
    prefetcher = DevicePrefetcher(loader, Recording())
    assert len(prefetcher) == len(ref) == 4
    _same(list(prefetcher), list(ref))
    _same(list(prefetcher), list(ref))  # epoch 1 in both
    assert prefetcher.epoch == loader.epoch == ref.epoch == 1
    prefetcher.set_epoch(7)
    ref.set_epoch(7)
    _same(list(prefetcher), list(ref))
    assert prefetcher.state_dict()["epoch"] == ref.state_dict()["epoch"] == 8 and loader.epoch == 7


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_distributed_gets_its_own_share(rank: int) -> None:
    loader = _loader(2, rank=rank, world_size=2)
    ref = list(_loader(2, rank=rank, world_size=2))
    _same(list(DevicePrefetcher(loader, Recording())), ref)
    _same(list(prefetch_to_device(_loader(2, rank=rank, world_size=2), "cpu")), ref)


def test_on_the_cpu_the_loaders_own_batches_and_iterator_pass_through() -> None:
    batches = [{"x": torch.ones(2, 3), "names": ["a", "b"]}, {"x": torch.zeros(2, 3), "names": ["c", "d"]}]
    threads = threading.active_count()
    prefetcher = prefetch_to_device(batches, "cpu")
    assert isinstance(prefetcher.strategy, PassThrough) and prefetcher.strategy.ahead == 0
    it = iter(prefetcher)
    assert type(it) is type(iter(batches))  # the list's own iterator: no layer, no thread, no copy
    got = list(it)
    assert all(a is b for a, b in zip(got, batches, strict=True))
    assert threading.active_count() == threads
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=False)
    _same(list(prefetch_to_device(loader, "cpu")), list(loader))


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


def test_another_device_gets_what_to_device_gives_at_hand_out() -> None:
    batches = [(Sample(torch.ones(2, 3), "a"), {"y": torch.zeros(2)}), (Sample(torch.ones(1, 3), "b"), {})]
    got = list(DevicePrefetcher(batches, PassThrough(torch.device("meta"))))  # meta stands in for mps
    ref = [(Sample(s.x.to("meta"), s.name), {k: v.to("meta") for k, v in d.items()}) for s, d in batches]
    assert [type(b[0]) for b in got] == [Sample, Sample] and [b[0].name for b in got] == ["a", "b"]
    for (s, d), (rs, rd) in zip(got, ref, strict=True):
        assert (s.x.device, s.x.shape, s.x.dtype) == (rs.x.device, rs.x.shape, rs.x.dtype)
        assert {k: (v.device, v.shape) for k, v in d.items()} == {
            k: (v.device, v.shape) for k, v in rd.items()
        }
    assert batches[0][0].x.device.type == "cpu"  # the loader's batches are left alone


def test_the_meta_device_is_refused_it_would_hand_out_batches_without_data() -> None:
    with pytest.raises(ValueError, match=r"device='meta'\): the meta device holds shapes, no data"):
        prefetch_to_device([torch.ones(2)], "meta")


# ------------------------------------------------------------------------------- resume with @accumulate
def _setup() -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = _loader()
    step = accumulate(3, opt)(lambda x, y: F.mse_loss(model(x), y))
    return model, opt, loader, step


def _train(
    stop_at: int | None = None, path: Path | None = None, resume: bool = False, wrapped: bool = False
) -> dict:
    """2 epochs, windows of 3 micro-steps (4 batches an epoch: a full window and a flushed one of 1);
    ``stop_at``: save after that many micro-steps and break out; ``resume``: load ``path`` first; ``wrapped``:
    save or load the prefetcher (else its loader)."""
    model, opt, loader, step = _setup()
    prefetcher = DevicePrefetcher(loader, Recording())
    if resume:
        load_checkpoint(path, model=model, optimizer=opt, step=step, loader=prefetcher if wrapped else loader)
    seen = []
    for _ in range(2 - loader.state_dict()["epoch"]):
        for idx, x, y in step.epoch(prefetcher):
            step(x, y)
            seen.append(idx)
            if step.step == stop_at:
                which = prefetcher if wrapped else loader
                save_checkpoint(path, model=model, optimizer=opt, step=step, loader=which)
                return {"seen": seen}
    return {"seen": seen, "weights": [p.detach().clone() for p in model.parameters()]}


def _reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The hand-written loop: plain epochs of the same loader, each window one big batch (SGD, momentum)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader, seen = _loader(), []
    for _ in range(2):
        batches = list(loader)
        seen += [b[0] for b in batches]
        for window in (batches[:3], batches[3:]):
            x, y = torch.cat([b[1] for b in window]), torch.cat([b[2] for b in window])
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return [p.detach() for p in model.parameters()], seen


@pytest.mark.parametrize("stop_at", range(1, 9))
def test_resume_from_a_checkpoint_mid_epoch_equals_the_uninterrupted_run(
    stop_at: int, tmp_path: Path
) -> None:
    ref_weights, ref_seen = _reference()
    full = _train()
    assert all(torch.equal(a, b) for a, b in zip(full["seen"], ref_seen, strict=True))
    torch.testing.assert_close(full["weights"], ref_weights, atol=1e-6, rtol=1e-5)
    path = tmp_path / "c.pt"
    wrapped = stop_at % 2 == 0
    first = _train(stop_at, path, wrapped=wrapped)  # the prefetcher saved and its loader loaded, or the other
    assert torch.load(path, weights_only=True)["_speedups"]["objects"]["loader"] == "DistributedLoader"
    second = _train(path=path, resume=True, wrapped=not wrapped)
    seen = first["seen"] + second["seen"]
    assert len(seen) == len(ref_seen) and all(torch.equal(a, b) for a, b in zip(seen, ref_seen, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(second["weights"], full["weights"], strict=True))


def test_epoch_sees_the_loader_through_the_prefetcher(tmp_path: Path) -> None:
    model, opt, loader, step = _setup()
    plain = _setup()[3]
    for _ in step.epoch(DevicePrefetcher(loader, Recording())):
        break
    for _ in plain.epoch(_loader()):
        break
    layout = loader.state_dict()
    assert step.state_dict()["feed"] == plain.state_dict()["feed"]
    assert step.state_dict()["feed"] == {k: layout[k] for k in ("batch_size", "samples", "world_size")}
    _train(4, tmp_path / "c.pt")  # saved mid-window (1 pending) after epoch 0's last batch
    model, opt, loader, step = _setup()
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step)  # the loader left out
    with pytest.raises(SpeedupsError, match="starts epoch 0 at batch 0: load it with the checkpoint too"):
        next(iter(step.epoch(DevicePrefetcher(loader, Recording()))))


def test_a_stop_signal_with_a_batch_in_flight_resumes_exactly(tmp_path: Path) -> None:
    def run(path: Path, signal_at: int | None = None) -> list[torch.Tensor]:
        model, opt, loader, step = _setup()
        prefetcher = DevicePrefetcher(loader, Recording())
        run = RunDirectory(path, every_updates=None, stop_on=["SIGUSR2"])
        try:
            values = run.resume(model=model, optimizer=opt, step=step, loader=prefetcher)
            for epoch in range(values.get("epoch", 0), 2):
                for _, x, y in step.epoch(prefetcher):
                    step(x, y)
                    if step.step == signal_at:
                        os.kill(os.getpid(), signal.SIGUSR2)
                    run.after_step(epoch=epoch)
        finally:
            if run.stop is not None:
                run.stop.close()
        run.close()
        return [p.detach().clone() for p in model.parameters()]

    ref = _train()["weights"]
    with pytest.raises(SystemExit) as exited:
        run(tmp_path, signal_at=6)  # epoch 1's second batch handed out, its third in flight
    assert exited.value.code == 75
    saved = torch.load(tmp_path / "ckpt-000000.pt", weights_only=True)
    assert (saved["loader"]["epoch"], saved["loader"]["batches"]) == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(run(tmp_path), ref, strict=True))


# ------------------------------------------------------------------------------------------- bad input
def _generator():
    yield torch.ones(1)


@pytest.mark.parametrize(
    ("loader", "error", "match"),
    [
        (3, TypeError, r"prefetch_to_device\(loader=<int>, device='cpu'\): loader=3 is not a loader"),
        (
            torch.ones(3),
            TypeError,
            r"loader=tensor\(\[1., 1., 1.\]\) is not a loader.*prefetch_to_device\(DataLoader",
        ),
        (iter([torch.ones(1)]), TypeError, r"loader is an iterator \(list_iterator\).*train_step.epoch\("),
        (_generator(), TypeError, r"loader=<generator>.*one pass only"),
        (DevicePrefetcher([1], Recording()), ValueError, r"already prefetches to .*Recording"),
    ],
)
def test_a_loader_that_is_not_one_is_refused(loader: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        prefetch_to_device(loader, "cpu")


def test_a_bad_device_or_strategy_is_refused_before_the_loader_moves() -> None:
    loader = _loader()
    with pytest.raises(ValueError, match=r"prefetch_to_device\(device='gpu'\): 'gpu' is not a device name"):
        prefetch_to_device(loader, "gpu")
    with pytest.raises(TypeError, match=r"prefetch_to_device\(device=1.5\): expected a torch.device"):
        prefetch_to_device(loader, 1.5)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(SpeedupsError, match=r"prefetch_to_device\(device='cuda'\): that device is not"):
            prefetch_to_device(loader, "cuda")
        with pytest.raises(ValueError, match=r"SideStreamCopy\(device='cpu'\): a side stream needs a CUDA"):
            SideStreamCopy(torch.device("cpu"))
    with pytest.raises(TypeError, match=r"strategy must have ahead \(an int\), start\(batch\) and finish"):
        DevicePrefetcher(loader, object())  # type: ignore[arg-type]
    bad = Recording()
    bad.ahead = -1
    with pytest.raises(ValueError, match=r"DevicePrefetcher\(.*\): strategy.ahead=-1: must be an int >= 0"):
        DevicePrefetcher(loader, bad)
    assert loader.epoch == -1 and loader.state_dict()["batches"] == 0  # nothing drawn, no pass started
    _same(list(loader), list(_loader()))


def test_a_checkpoint_refuses_a_prefetcher_over_a_loader_without_a_position(tmp_path: Path) -> None:
    prefetcher = prefetch_to_device(DataLoader(_data(), batch_size=2), "cpu")
    with pytest.raises(TypeError, match=r"loader=DevicePrefetcher.*A plain DataLoader has no state"):
        save_checkpoint(tmp_path / "c.pt", loader=prefetcher)
    assert not (tmp_path / "c.pt").exists()


# ------------------------------------------------------------------------------------------------ CUDA
class StreamSeen:
    """A batch leaf that moves itself, recording the current CUDA stream when its copy is issued."""

    streams: ClassVar[list[torch.cuda.Stream]] = []

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> StreamSeen:
        StreamSeen.streams.append(torch.cuda.current_stream(device))
        return StreamSeen(self.t.to(device, non_blocking=True))


@pytest.mark.cuda
def test_cuda_batches_equal_to_device_and_are_copied_on_a_side_stream() -> None:
    from speedups import to_device

    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 256, generator=g), torch.randint(0, 9, (64,), generator=g))
    loader = DataLoader(data, batch_size=8, pin_memory=True)
    prefetcher = prefetch_to_device(loader, device)
    assert isinstance(prefetcher.strategy, SideStreamCopy)
    side = prefetcher.strategy.stream
    assert side != torch.cuda.default_stream(device) and side != torch.cuda.current_stream(device)
    for _ in range(2):  # two epochs
        got = [(x * 2, y + 1) for x, y in prefetcher]  # kernels on the compute stream read each batch
        ref = [(x.to(device) * 2, y.to(device) + 1) for x, y in loader]
        assert len(got) == len(ref) == 8
        for (x, y), (rx, ry) in zip(got, ref, strict=True):
            assert x.device == device and torch.equal(x, rx) and torch.equal(y, ry)
    moved = next(iter(prefetch_to_device([{"x": torch.ones(3).pin_memory()}], device)))
    assert torch.equal(moved["x"], to_device({"x": torch.ones(3)}, device)["x"])
    StreamSeen.streams.clear()
    batches = [StreamSeen(torch.full((4,), float(i)).pin_memory()) for i in range(3)]
    prefetcher = prefetch_to_device(batches, device)
    out = [b.t.clone() for b in prefetcher]
    assert StreamSeen.streams and all(s == prefetcher.strategy.stream for s in StreamSeen.streams)
    assert all(s != torch.cuda.default_stream(device) for s in StreamSeen.streams)
    assert all(torch.equal(o.cpu(), torch.full((4,), float(i))) for i, o in enumerate(out))


def test_the_leaves_walked_for_record_stream_are_the_ones_to_device_moves() -> None:
    from collections import OrderedDict, deque

    from torch.nn.utils.rnn import pack_sequence

    from speedups._helpers.tree import tree_leaves, tree_map

    packed = pack_sequence([torch.ones(3), torch.ones(2)])
    batch = {
        "a": [torch.zeros(1), (torch.ones(2), "s")],
        "b": OrderedDict(c=deque([Sample(torch.ones(1), "n")])),
    }
    batch["p"] = packed  # type: ignore[assignment]
    seen: list[Any] = []
    tree_map(lambda leaf: seen.append(leaf) or leaf, batch)  # the walk to_device's tree_map makes
    leaves = list(tree_leaves(batch))
    assert len(leaves) == len(seen) and all(a is b for a, b in zip(leaves, seen, strict=True))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    assert len(tensors) == 3 + 2  # zeros(1), ones(2), Sample.x, and the packed data and batch sizes
