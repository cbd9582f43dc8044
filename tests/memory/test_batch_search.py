"""find_batch_size: the size returned really ran and all state is restored bitwise; accumulation_plan."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

from speedups import AccumulationPlan, SpeedupsError, accumulation_plan, find_batch_size
from speedups._helpers.oom import is_out_of_memory as _is_out_of_memory

# torch.OutOfMemoryError is newer (2.5) than torch.cuda.OutOfMemoryError, which is now an alias of it.
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Net(nn.Module):
    """Linear - BatchNorm - ReLU - Dropout - Linear, with a frozen embedding-like parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(self.body(x))


def _setup(train: bool, used: bool) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if used:  # an optimizer with state and step counts, a BatchNorm with statistics
        for _ in range(2):
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
    model.head.bias.requires_grad_(False)  # a frozen parameter
    opt.zero_grad(set_to_none=True)
    model.head.weight.grad = torch.randn_like(model.head.weight)  # one tensor grad, the rest None
    model.train(train)
    model.body[1].eval()  # a module whose flag differs from its parent's
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": copy.deepcopy(model.state_dict()),
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": copy.deepcopy(opt.state_dict()),
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_objects": [p.grad for p in model.parameters()],
        "params": list(model.parameters()),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "random_rng": random.getstate(),
    }


def _assert_equal(a: object, b: object, where: str = "") -> None:
    """Bitwise equality of nested states (tensors compared with torch.equal and dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def _assert_restored(before: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    after = _state(model, opt)
    for key in before:
        if key in ("params", "grad_objects"):  # the same objects: references held elsewhere stay valid
            assert all(x is y for x, y in zip(before[key], after[key], strict=True)), key
        else:
            _assert_equal(before[key], after[key], key)


def _probe(model: Net, opt: torch.optim.Optimizer, limit: int, log: list[tuple[int, bool]]):
    """A training step that changes everything it can, then 'runs out of memory' above ``limit``."""

    def step(batch_size: int) -> None:
        model.train()  # a careless probe switches modes
        model.body[0].weight.requires_grad_(False)
        if batch_size > limit and batch_size == 1:  # BatchNorm cannot train on one sample: fail first
            raise OOM("CUDA out of memory. Tried to allocate 1 GiB")
        x = torch.randn(batch_size, 6)
        np.random.rand(), random.random()
        loss = model(x).pow(2).mean()  # BatchNorm statistics move here, before the failure
        if batch_size > limit:
            log.append((batch_size, False))
            raise OOM(f"CUDA out of memory. Tried to allocate {batch_size} GiB")
        loss.backward()
        opt.step()
        log.append((batch_size, True))

    return step


@pytest.mark.parametrize("used", [False, True], ids=["fresh-adam", "used-adam"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("mode", "expected"), [("power", 32), ("binsearch", 45)])
def test_returns_a_size_that_ran_and_restores_everything(
    train: bool, used: bool, mode: str, expected: int
) -> None:
    model, opt = _setup(train, used)
    before = _state(model, opt)
    log: list[tuple[int, bool]] = []
    size = find_batch_size(_probe(model, opt, 45, log), model, opt, start=2, mode=mode)
    assert size == expected
    assert (size, True) in log and (2 * size if mode == "power" else size + 1, False) in log
    assert all(ok == (bs <= 45) for bs, ok in log)
    _assert_restored(before, model, opt)


def test_training_after_the_probe_matches_a_model_never_probed() -> None:
    model, opt = _setup(train=True, used=True)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict shares "step" tensors
    find_batch_size(_probe(model, opt, 20, []), model, opt, mode="binsearch")
    for m, o in ((model, opt), (ref_model, ref_opt)):
        torch.manual_seed(3)
        for _ in range(3):
            o.zero_grad()
            m(torch.randn(16, 6)).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    torch.testing.assert_close(model.body[1].running_var, ref_model.body[1].running_var, rtol=0, atol=0)


def test_a_non_oom_error_is_reraised_unchanged_and_state_restored() -> None:
    model, opt = _setup(train=True, used=True)
    before = _state(model, opt)
    boom = ValueError("shapes do not match")

    def step(batch_size: int) -> None:
        model(torch.randn(batch_size, 6)).sum().backward()
        opt.step()
        if batch_size == 8:
            raise boom

    with pytest.raises(ValueError) as info:
        find_batch_size(step, model, opt)
    assert info.value is boom
    _assert_restored(before, model, opt)


def test_cpu_allocator_error_counts_as_out_of_memory() -> None:
    model, opt = _setup(train=True, used=False)

    def step(batch_size: int) -> None:
        if batch_size > 16:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:116] data. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 123456789 bytes."
            )
        model(torch.randn(batch_size, 6)).sum().backward()

    assert find_batch_size(step, model, opt, start=4) == 16
    assert _is_out_of_memory(RuntimeError("not enough memory: you tried to allocate 1 GB"))
    assert _is_out_of_memory(torch.cuda.OutOfMemoryError("x")) and _is_out_of_memory(OOM("x"))
    assert not _is_out_of_memory(RuntimeError("Expected more than 1 value per channel"))
    assert not _is_out_of_memory(MemoryError())  # Python's own: not the allocator


def test_max_size_caps_the_search_and_is_tried_itself() -> None:
    model, _ = _setup(train=True, used=False)
    tried: list[int] = []
    assert find_batch_size(tried.append, model, start=3, max_size=20) == 20
    assert tried == [3, 6, 12, 20]


def test_a_failing_start_backs_off_to_a_size_that_runs() -> None:
    model, opt = _setup(train=False, used=False)
    before = _state(model, opt)
    log: list[tuple[int, bool]] = []
    assert find_batch_size(_probe(model, opt, 10, log), model, opt, start=64) == 8
    assert [bs for bs, _ in log] == [64, 32, 16, 8]
    log.clear()
    assert find_batch_size(_probe(model, opt, 10, log), model, opt, start=64, mode="binsearch") == 10
    _assert_restored(before, model, opt)


def test_even_size_one_out_of_memory_raises_with_state_restored() -> None:
    model, opt = _setup(train=True, used=True)
    before = _state(model, opt)
    with pytest.raises(SpeedupsError, match="even batch size 1 runs out of memory"):
        find_batch_size(_probe(model, opt, 0, []), model, opt, start=4)
    _assert_restored(before, model, opt)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"start": 0},
            ValueError,
            r"find_batch_size\(start=0.*: start=0: must be an int >= 1\. Write start=2",
        ),
        ({"start": 64, "max_size": 32}, ValueError, "start is larger than max_size"),
        ({"mode": "linear"}, ValueError, r"unknown mode. Allowed: \('power', 'binsearch'\)"),
        ({"start": 2.0}, TypeError, r"start=2\.0: expected an int >= 1, got float"),
        ({"max_size": 0}, ValueError, r"max_size=0: must be an int >= 1 or None"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs: dict, error: type[Exception], match: str) -> None:
    model, opt = _setup(train=True, used=False)
    before = _state(model, opt)
    calls: list[int] = []
    with pytest.raises(error, match=match):
        find_batch_size(calls.append, model, opt, **kwargs)
    assert calls == []
    _assert_restored(before, model, opt)


def test_bad_step_model_or_optimizer_types() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="step must be a callable"):
        find_batch_size(3, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be the torch\.nn\.Module"):
        find_batch_size(print, "model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        find_batch_size(print, model, optimizer="adam")  # type: ignore[arg-type]


@pytest.mark.cuda
def test_real_cuda_out_of_memory_is_caught_and_state_restored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    opt = torch.optim.Adam(model.parameters())
    before_model = copy.deepcopy(model.state_dict())
    cuda_rng = torch.cuda.get_rng_state_all()
    gib = 2**28  # float32 elements in 1 GiB
    total = torch.cuda.get_device_properties(0).total_memory / 2**30

    def step(batch_size: int) -> None:
        hog = torch.empty(batch_size, gib, device="cuda")  # batch_size GiB, as activations would
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        opt.step()
        del hog

    size = find_batch_size(step, model, opt, start=1, mode="binsearch")
    assert 1 <= size <= total < size + 1 + total * 0.2  # it found (nearly) the whole device
    torch.empty(size, gib, device="cuda")  # and that size fits again: the probe freed its memory
    _assert_equal(before_model, model.state_dict())
    assert len(opt.state) == 0
    _assert_equal(cuda_rng, torch.cuda.get_rng_state_all())


# ------------------------------------------------------------------------------------------ accumulation_plan
@pytest.mark.parametrize(
    ("target", "max_micro", "world", "expected"),
    [
        (256, 48, 1, (32, 8)),
        (256, 256, 1, (256, 1)),
        (256, 1000, 2, (128, 1)),
        (384, 100, 4, (96, 1)),
        (1000, 64, 1, (50, 20)),
        (97, 64, 1, (1, 97)),  # a prime: exact, though slow
    ],
)
def test_accumulation_plan_is_exact_and_uses_the_largest_micro_batch(
    target: int, max_micro: int, world: int, expected: tuple[int, int]
) -> None:
    plan = accumulation_plan(target, max_micro, world_size=world)
    assert (plan.micro_batch_size, plan.accumulation_steps) == expected
    assert plan.effective_batch_size == target and plan.micro_batch_size <= max_micro
    assert isinstance(plan, AccumulationPlan) and plan.world_size == world


def test_accumulation_plan_reads_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert accumulation_plan(512, 64) == AccumulationPlan(64, 2, 4)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 8), {}, ValueError, r"effective_batch_size=0: must be an int >= 1"),
        ((64, 0), {}, ValueError, r"max_micro_batch_size=0: must be an int >= 1"),
        ((63, 8), {"world_size": 2}, ValueError, "not divisible by the world size 2"),
        ((64.0, 8), {}, TypeError, r"effective_batch_size=64\.0: expected an int >= 1, got float"),
        ((64, 8), {"world_size": 0}, ValueError, r"world_size=0: must be an int >= 1"),
    ],
)
def test_accumulation_plan_bad_input(args: tuple, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        accumulation_plan(*args, **kwargs)


def test_accumulation_plan_matches_brute_force_and_is_fast_on_large_inputs() -> None:
    import random

    from speedups.memory.batch_search import _largest_divisor_at_most

    rng = random.Random(0)
    for _ in range(2000):
        n, limit = rng.randint(1, 3000), rng.randint(1, 4000)
        assert _largest_divisor_at_most(n, limit) == max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
    plan = accumulation_plan(10**12, 10**12, world_size=1)  # was a loop over 10**12 candidates
    assert (plan.micro_batch_size, plan.accumulation_steps) == (10**12, 1)
    plan = accumulation_plan(2 * 999_983 * 8, 1000, world_size=2)  # per rank 8 * a large prime
    assert plan.micro_batch_size * plan.accumulation_steps == 999_983 * 8 and plan.micro_batch_size == 8


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
            "non-contiguous input."
        ),
        lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"),
        lambda: OOM("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
    ids=["cudnn-not-supported", "cuda-runtime-text", "OutOfMemoryError"],
)
def test_cudnn_large_batch_and_old_cuda_texts_back_off(make_error) -> None:
    model, opt = _setup(train=True, used=True)
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())

    def step(batch_size: int) -> None:
        if batch_size > 96:
            raise make_error()
        model(torch.randn(batch_size, 6)).pow(2).mean().backward()
        opt.step()

    assert find_batch_size(step, model, opt, start=2, mode="binsearch") == 96
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(opt_before)


def test_a_step_whose_memory_does_not_grow_stops_with_the_fix() -> None:
    model, opt = _setup(train=True, used=False)
    before = copy.deepcopy(model.state_dict())
    fixed = torch.randn(2, 6)
    sizes: list[int] = []

    def step(batch_size: int) -> None:  # ignores its argument
        sizes.append(batch_size)
        model(fixed).sum().backward()
        opt.step()

    with pytest.raises(SpeedupsError, match=r"does not grow with batch_size.*max_size=4096"):
        find_batch_size(step, model, opt)
    assert sizes == [2**k for k in range(1, 25)]  # doubled up to 2**24, then stopped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state
    assert find_batch_size(step, model, opt, max_size=2**30) == 2**30  # an explicit bound is honoured


def test_accumulation_plan_refuses_an_effective_batch_too_large_to_factor_quickly() -> None:
    with pytest.raises(ValueError, match=r"effective_batch_size=1000.*<= 1099511627776"):
        accumulation_plan(10**400, 2, world_size=1)  # factoring it would loop for ever
    assert accumulation_plan(2**40, 2**20, world_size=1) == (2**20, 2**20, 1)
