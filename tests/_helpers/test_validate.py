"""The shared argument checks: what each accepts, and the call's context added exactly once."""

from __future__ import annotations

import pytest
import torch

from speedups._helpers import validate as _validate


def test_arguments_prefixes_the_call_once_even_when_nested() -> None:
    with pytest.raises(ValueError) as info, _validate.arguments("outer(x=0)"), _validate.arguments("inner()"):
        _validate.integer(0, "x", minimum=1, example="4")
    assert str(info.value) == "inner(): x=0: must be an int >= 1. Write x=4."


def test_arguments_leaves_other_errors_alone() -> None:
    with pytest.raises(KeyError), _validate.arguments("f()"):
        raise KeyError("k")
    with pytest.raises(ValueError) as info, _validate.arguments("f()"):
        raise ValueError("two", "args")
    assert info.value.args == ("two", "args")


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (True, {}, TypeError, "n=True: expected an int, got bool."),
        (2.0, {"minimum": 1}, TypeError, "n=2.0: expected an int >= 1, got float."),
        (0, {"minimum": 1, "none_ok": True}, ValueError, "n=0: must be an int >= 1 or None."),
        (9, {"minimum": 0, "maximum": 8}, ValueError, "n=9: must be an int >= 0 and <= 8."),
    ],
)
def test_integer_refuses(value: object, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        _validate.integer(value, "n", **kwargs)
    assert str(info.value) == message


def test_integer_accepts() -> None:
    assert _validate.integer(3, "n", minimum=1) == 3
    assert _validate.integer(None, "n", none_ok=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "error"),
    [
        (False, {}, TypeError),
        ("1", {}, TypeError),
        (float("nan"), {}, ValueError),
        (float("inf"), {}, ValueError),
        (10**400, {}, ValueError),  # too large for a float: infinite, not an OverflowError
        (0, {"positive": True}, ValueError),
        (-1e-9, {"non_negative": True}, ValueError),
        (None, {}, TypeError),
    ],
)
def test_real_refuses(value: object, kwargs: dict, error: type) -> None:
    with pytest.raises(error, match=r"^x="):
        _validate.real(value, "x", **kwargs)


def test_real_accepts_and_returns_a_float() -> None:
    assert _validate.real(2, "x", positive=True) == 2.0
    assert isinstance(_validate.real(2, "x"), float)
    assert _validate.real(float("inf"), "x", finite=False) == float("inf")
    assert _validate.real(None, "x", none_ok=True) is None
    assert _validate.real(0, "x", non_negative=True) == 0.0


def test_flag_and_instance() -> None:
    assert _validate.flag(False, "f") is False
    with pytest.raises(TypeError, match=r"^f=1: expected True or False, got int\.$"):
        _validate.flag(1, "f")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert _validate.instance(opt, torch.optim.Optimizer, "optimizer", what="an optimizer") is opt
    with pytest.raises(TypeError, match=r"^optimizer='x{56}\.\.\.: expected an optimizer, got str\.$"):
        _validate.instance("x" * 100, torch.optim.Optimizer, "optimizer", what="an optimizer")
