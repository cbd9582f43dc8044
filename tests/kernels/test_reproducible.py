"""deterministic(): torch's flags, cuBLAS's variable and the seeds set, and all of it put back exactly."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from speedups import SpeedupsError, SpeedupsWarning
from speedups.kernels.reproducible import CUBLAS_CONFIG, deterministic
from tests._dist import ROOT, WORKERS


def _flags() -> tuple:
    cudnn = torch.backends.cudnn
    return (
        cudnn.deterministic,
        cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        os.environ.get(CUBLAS_CONFIG),
    )


def _set_flags(flags: tuple) -> None:
    cudnn = torch.backends.cudnn
    cudnn.deterministic, cudnn.benchmark = flags[0], flags[1]
    torch.use_deterministic_algorithms(flags[2], warn_only=flags[3])
    if flags[4] is None:
        os.environ.pop(CUBLAS_CONFIG, None)
    else:
        os.environ[CUBLAS_CONFIG] = flags[4]


@pytest.fixture(autouse=True)
def _put_back() -> Iterator[None]:
    """These tests change process-wide flags on purpose: whatever happens, leave them as found."""
    before = _flags()
    yield
    _set_flags(before)


def _draws() -> tuple:
    return torch.rand(3), random.random(), float(np.random.rand())


# ------------------------------------------------------------------------------------- set, then put back
@pytest.mark.parametrize(
    "start",
    [
        (False, False, False, False, None),  # torch's defaults, the variable unset
        (True, True, False, True, ":16:8"),  # cuDNN benchmarking on, warn_only left set, a valid variable
        (False, True, True, False, ":0:0"),  # deterministic already, a variable cuBLAS is not exact with
    ],
    ids=["defaults", "benchmark and a valid variable", "already deterministic, a bad variable"],
)
@pytest.mark.parametrize("warn_only", [False, True])
def test_flags_and_variable_are_set_then_restored_exactly(start: tuple, warn_only: bool) -> None:
    _set_flags(start)
    switch = deterministic(seed=None, warn_only=warn_only)
    kept = start[4] if start[4] in (":4096:8", ":16:8") else ":4096:8"
    assert _flags() == (True, False, True, warn_only, kept)
    assert switch.active and switch.changed[CUBLAS_CONFIG] == (start[4], kept)
    switch.restore()
    assert _flags() == start and not switch.active
    switch.restore()  # a second restore does nothing
    assert _flags() == start


def test_as_a_context_manager_it_restores_on_the_way_out_even_after_an_error() -> None:
    before = _flags()
    with pytest.raises(KeyError), deterministic(seed=1) as switch:
        assert _flags()[:3] == (True, False, True) and switch.active
        raise KeyError("the loop failed")
    assert _flags() == before and not switch.active
    refused = r"already restored.*Make a new one: with deterministic\(seed=0\)"
    with pytest.raises(SpeedupsError, match=refused), switch:
        pass


def test_nested_switches_restore_innermost_first() -> None:
    before = _flags()
    with deterministic(seed=0, warn_only=True):
        outer = _flags()
        with deterministic(seed=0):
            assert _flags()[3] is False
        assert _flags() == outer
    assert _flags() == before


def test_restoring_out_of_order_is_refused_before_anything_changes_and_in_order_puts_back_the_start() -> None:
    """Outer first would put back the outer's findings under the inner switch, and the inner's restore then
    the outer's settings: deterministic algorithms on after both (the field case). Refused, unchanged."""
    before, rng = _flags(), torch.get_rng_state()
    outer = deterministic(seed=0, warn_only=True)
    inner = deterministic(seed=1)
    inside, inside_rng = _flags(), torch.get_rng_state()
    refused = (
        r"^deterministic\(seed=0, per_rank=False, warn_only=True, enabled=True\)\.restore\(\), on the one "
        r"made at .*: the one made at .* \(newer\), deterministic\(seed=1, .*\), is still in force\..*"
        r"nothing was changed\. Restore switches newest first: the one made at "
    )
    with pytest.raises(SpeedupsError, match=refused):
        outer.restore()
    assert _flags() == inside and torch.equal(torch.get_rng_state(), inside_rng)
    assert outer.active and inner.active
    third = deterministic(seed=2)
    with pytest.raises(
        SpeedupsError, match=r"2 made after it are still in force, .*\(newest: deterministic\(seed=2, "
    ):
        outer.restore()
    third.restore()
    inner.restore()
    outer.restore()
    assert _flags() == before and torch.equal(torch.get_rng_state(), rng)


def _line() -> int:
    """The caller's line."""
    return sys._getframe(1).f_lineno


HERE = os.path.relpath(__file__)


def test_an_out_of_order_restore_names_each_switch_by_where_it_was_made_and_its_order() -> None:
    """The trial: two deterministic(seed=0) in force, the older restored first; the refusal printed both
    as the same call, so which was newer could not be told. Each is now named by the user's file:line that
    made it and by its order, and the fix names them in the order to restore; made on one line (a helper,
    a loop), the order still tells them apart."""
    outer, outer_at = deterministic(seed=0), f"{HERE}:{_line()}"
    inner, inner_at = deterministic(seed=0), f"{HERE}:{_line()}"
    with pytest.raises(SpeedupsError) as refused:
        outer.restore()
    assert str(refused.value).startswith(
        f"deterministic(seed=0, per_rank=False, warn_only=False, enabled=True).restore(), on the one made at "
        f"{outer_at} (older): the one made at {inner_at} (newer), deterministic(seed=0, per_rank=False, "
        f"warn_only=False, enabled=True), is still in force. "
    )
    assert str(refused.value).endswith(
        f"Restore switches newest first: the one made at {inner_at} (its restore(), or the end of its with "
        f"block), then the one made at {outer_at}."
    )
    third, third_at = deterministic(seed=0), f"{HERE}:{_line()}"
    with pytest.raises(SpeedupsError) as refused:
        outer.restore()
    assert f"2 made after it are still in force, at {inner_at} and {third_at} (newest: " in str(refused.value)
    assert f"newest first: the ones made at {third_at}, then {inner_at} (" in str(refused.value)
    with pytest.raises(
        TypeError, match=rf"stays in force \(made at {outer_at}\), .*at {third_at}, {inner_at}:"
    ):
        outer(print)
    third.restore()
    inner.restore()
    outer.restore()

    def make() -> deterministic:
        return deterministic(seed=0)  # both made on this line

    line = f"{HERE}:{_line() - 2}"
    first, second = make(), make()
    with pytest.raises(
        SpeedupsError, match=rf"on the one made at {line} \(older\): the one made at {line} \(newer\)"
    ):
        first.restore()
    second.restore()
    first.restore()
    assert not first.active and not second.active


def test_used_as_a_decorator_it_is_refused_and_leaves_nothing_changed() -> None:
    """@deterministic(seed=0) made the switch (flags, variable, seeds) before it saw the function: the
    TypeError comes once that is put back; @deterministic bare is refused before anything changes."""
    before, rng = _flags(), torch.get_rng_state()
    with pytest.raises(
        TypeError,
        match=r"^@deterministic\(seed=0, .*\) on .*train: a switch is not a decorator\..*is put back\. Write "
        r"it inside the function: with deterministic\(seed=0\): \.\.\.$",
    ):

        @deterministic(seed=0)
        def train() -> None:
            pass

    assert _flags() == before and torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(TypeError, match=r"^@deterministic on .*train: deterministic is a switch, not a"):

        @deterministic  # type: ignore[arg-type]
        def train() -> None:
            pass

    assert _flags() == before and torch.equal(torch.get_rng_state(), rng)
    with deterministic(seed=0) as outer:  # not the newest: left in force, and said so
        inner = deterministic(seed=1)
        stays = r"It stays in force \(made at .*\), since switches made after it are \(at "
        with pytest.raises(TypeError, match=stays):
            outer(print)
        assert outer.active
        inner.restore()
    assert _flags() == before


def test_seeds_every_stream_then_puts_the_streams_back() -> None:
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    untouched = _draws()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with deterministic(seed=3) as switch:
        seeded = _draws()
    after = _draws()  # the streams continue where they were before the block
    assert torch.equal(after[0], untouched[0]) and after[1:] == untouched[1:]
    assert switch.seed == 3
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = _draws()
    assert torch.equal(seeded[0], expected[0]) and seeded[1:] == expected[1:]


def test_per_rank_adds_the_rank_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with deterministic(seed=7) as same:
        a = torch.rand(2)
    with deterministic(seed=7, per_rank=True) as own:
        b = torch.rand(2)
    assert (same.seed, own.seed) == (7, 8)
    for seed, drawn in ((7, a), (8, b)):
        torch.manual_seed(seed)
        assert torch.equal(drawn, torch.rand(2))


def test_enabled_false_changes_nothing() -> None:
    before, rng = _flags(), torch.get_rng_state()
    with deterministic(seed=3, enabled=False) as switch:
        assert _flags() == before and torch.equal(torch.get_rng_state(), rng)
    assert not switch.active and switch.changed == {} and "off" in repr(switch)
    switch.restore()
    assert _flags() == before


def test_an_op_without_a_deterministic_kernel_raises_or_warns_and_the_report_says_so() -> None:
    def put() -> torch.Tensor:  # put_ without accumulate has no deterministic kernel, on the CPU too
        return torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))

    with deterministic(seed=0) as switch, pytest.raises(RuntimeError, match="put_"):
        put()
    assert "raise RuntimeError" in switch.limits[0] and "not deterministic: ops" in repr(switch)
    with deterministic(seed=0, warn_only=True) as switch, pytest.warns(UserWarning, match="put_"):
        put()
    assert "warn when called" in switch.limits[0]
    put()  # restored: allowed again


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": -1}, ValueError, r"deterministic\(seed=-1, .*\): seed=-1: must be an int >= 0"),
        ({"seed": 2**32}, ValueError, r"seed=4294967296: must be an int >= 0 and <= 4294967295"),
        ({"seed": "0"}, TypeError, r"seed='0': expected an int"),
        ({"seed": True}, TypeError, r"seed=True: expected an int"),
        ({"seed": None, "per_rank": True}, ValueError, r"per_rank=True adds the rank.*Pass seed=0"),
        ({"seed": 0, "warn_only": 1}, TypeError, r"warn_only=1: expected True or False"),
        ({"seed": 0, "per_rank": "yes"}, TypeError, r"per_rank='yes': expected True or False"),
        ({"seed": 0, "enabled": None}, TypeError, r"enabled=None: expected True or False"),
    ],
)
def test_bad_arguments_raise_before_anything_changes(kwargs: dict, error: type, match: str) -> None:
    before, rng = _flags(), torch.get_rng_state()
    with pytest.raises(error, match=match):
        deterministic(**kwargs)
    assert _flags() == before and torch.equal(torch.get_rng_state(), rng)


def test_a_seed_plus_rank_past_numpys_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"seed \+ rank = 4294967298 on rank 3"):
        deterministic(seed=2**32 - 1, per_rank=True)


# ------------------------------------------------------------------------------- two fresh runs, bit for bit
def _train(seed: int, out: Path) -> dict[str, torch.Tensor]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(WORKERS / "determinism_train.py"), str(seed), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_two_fresh_runs_with_two_workers_and_augmentation_give_bitwise_equal_weights(tmp_path: Path) -> None:
    first, second, other = (_train(seed, tmp_path / f"{i}.pt") for i, seed in enumerate((0, 0, 1)))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert any(not torch.equal(first[name], other[name]) for name in first)  # the seed decides


# ------------------------------------------------------------------------------------------------ CUDA only
_CUDA_TWICE = """
import torch
from speedups.kernels.reproducible import deterministic

switch = deterministic(seed=0)  # first, before any CUDA work: cuBLAS then reads the variable
conv = torch.nn.Conv2d(3, 8, 3).cuda()
results = []
for _ in range(2):
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, 32, device="cuda", requires_grad=True)
    conv.zero_grad()
    conv(x).square().sum().backward()  # cuDNN convolution backward
    index = torch.randint(0, 4, (4096,), device="cuda")
    added = torch.zeros(4, device="cuda").index_add_(0, index, torch.rand(4096, device="cuda"))
    product = x[0, 0] @ x[0, 0].T  # cuBLAS
    results.append([conv.weight.grad.clone(), x.grad.clone(), added, product])
assert all(torch.equal(a, b) for a, b in zip(*results)), "not bit for bit"
assert not switch.limits[0].startswith("cuBLAS"), switch.limits
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_kernels_repeat_bit_for_bit_in_a_fresh_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != CUBLAS_CONFIG} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_TWICE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.cuda
def test_cuda_initialised_before_the_variable_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.cuda.init()
    monkeypatch.delenv(CUBLAS_CONFIG, raising=False)
    with pytest.warns(SpeedupsWarning, match=r"CUDA was initialised before CUBLAS_WORKSPACE_CONFIG"):
        switch = deterministic(seed=0)
    assert switch.limits[0].startswith("cuBLAS")
    switch.restore()
    assert CUBLAS_CONFIG not in os.environ
