"""fast_kernels(): TF32, cuDNN autotuning and channels_last set, refused or left alone, and all put back.

Every TF32 setting is read back through each API torch has (the older and the per-operation ones), before and
after, so "put back" means: each view reads what it read before, including the views torch refuses to read.
On this CPU the flags are set for real (they are process-wide and harmless here); "a GPU" is pretended where
the device decides, by replacing the device lookup and the capability.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import speedups.precision as precision_module
from speedups import SpeedupsError, SpeedupsWarning, deterministic, fast_kernels, mixed_precision
from speedups._helpers import env, kernel_switches
from speedups.kernels import tf32

RAISES = "raises"  # what a view reads when torch refuses to read it (a state set by mixing the APIs)
NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")
# torch's default for cuda matmuls ("none" on torch 2.14: inherit), read rather than assumed
UNSET = torch.backends.cuda.matmul.fp32_precision if NEW_API else "none"
needs_new_api = pytest.mark.skipif(not NEW_API, reason="torch before 2.9 has no fp32_precision settings")


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except RuntimeError:
        return RAISES


def _views() -> dict[str, Any]:
    """Every setting fast_kernels may touch, read through every API this torch has."""
    cudnn = torch.backends.cudnn
    reads: dict[str, Callable[[], Any]] = {
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: cudnn.allow_tf32,
        "cudnn.benchmark": lambda: cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled,
    }
    if NEW_API:
        reads["cuda.matmul.fp32_precision"] = lambda: torch.backends.cuda.matmul.fp32_precision
        reads["mkldnn.matmul.fp32_precision"] = lambda: torch.backends.mkldnn.matmul.fp32_precision
        reads["cudnn.conv.fp32_precision"] = lambda: cudnn.conv.fp32_precision
        reads["cudnn.rnn.fp32_precision"] = lambda: cudnn.rnn.fp32_precision
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # torch 2.9's notice on reading the older settings: not under test here
        return {name: _read(read) for name, read in reads.items()}


def _put_back_views(views: dict[str, Any]) -> None:
    """Set every view back: the older calls first (they set the newer settings too), then the newer ones."""
    cudnn = torch.backends.cudnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.9's notice on the older calls
        legacy = views["get_float32_matmul_precision"]
        torch.set_float32_matmul_precision("highest" if legacy == RAISES else legacy)
        cudnn.allow_tf32 = views["cudnn.allow_tf32"] is not False
    if NEW_API:
        torch.backends.cuda.matmul.fp32_precision = views["cuda.matmul.fp32_precision"]
        torch.backends.mkldnn.matmul.fp32_precision = views["mkldnn.matmul.fp32_precision"]
        cudnn.conv.fp32_precision = views["cudnn.conv.fp32_precision"]
        cudnn.rnn.fp32_precision = views["cudnn.rnn.fp32_precision"]
    cudnn.benchmark = views["cudnn.benchmark"]
    torch.use_deterministic_algorithms(views["deterministic"])


@pytest.fixture(autouse=True)
def _put_back() -> Iterator[None]:
    """These tests change process-wide flags on purpose: leave them as found, and no switch left in force."""
    before = _views()
    yield
    leaked = [kind for kind in ("fast_kernels", "deterministic") if kernel_switches.find(kind) is not None]
    for kind in leaked:
        switch = kernel_switches.find(kind)
        switch.restore()  # type: ignore[union-attr]
    _put_back_views(before)
    assert _views() == before
    assert not leaked, f"a test left {leaked} in force"


@pytest.fixture
def ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this process's device is an Ampere GPU with cuDNN (the flags are still set for real)."""
    monkeypatch.setattr(env, "device", lambda *a, **k: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)


@pytest.fixture
def cublas_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """deterministic() without its warning on a GPU machine where CUDA was initialised by an earlier test."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's device is its CPU, on a GPU machine too."""
    monkeypatch.setattr(env, "device", lambda *a, **k: torch.device("cpu"))


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 1),  # a 1x1 kernel: its weight is contiguous in both layouts
        nn.ConvTranspose2d(16, 8, 2, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _layouts(model: nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    """Each parameter and gradient: name, strides, whether contiguous (what "memory format" means here)."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, p.stride(), p.is_contiguous()))
        if p.grad is not None:
            out.append((name + ".grad", p.grad.stride(), p.grad.is_contiguous()))
    return out


CL = torch.channels_last


# ----------------------------------------------------------------------- TF32: every start state, both APIs
_MATMUL_STARTS = list(
    itertools.product(["highest", "high", "medium"], [UNSET, "ieee", "tf32"], [UNSET, "ieee", "bf16"])
)


@needs_new_api
@pytest.mark.parametrize(("legacy", "cuda", "cpu"), _MATMUL_STARTS, ids=["-".join(s) for s in _MATMUL_STARTS])
def test_matmul_tf32_is_set_in_every_view_that_was_readable_then_put_back_exactly(
    legacy: str, cuda: str, cpu: str
) -> None:
    torch.set_float32_matmul_precision(legacy)
    torch.backends.cuda.matmul.fp32_precision = cuda
    torch.backends.mkldnn.matmul.fp32_precision = cpu
    before = _views()
    change = tf32.allow_matmul()
    after = _views()
    assert after["cuda.matmul.fp32_precision"] == "tf32"
    assert after["mkldnn.matmul.fp32_precision"] == cpu  # oneDNN's (CPU) matmuls are not ours to change
    if before["get_float32_matmul_precision"] != RAISES:  # a readable older view stays readable, and agrees
        assert after["get_float32_matmul_precision"] in ("high", "medium")
        assert after["cuda.matmul.allow_tf32"] is True
    untouched = (
        "cudnn.conv.fp32_precision",
        "cudnn.rnn.fp32_precision",
        "cudnn.allow_tf32",
        "cudnn.benchmark",
    )
    assert all(after[k] == before[k] for k in untouched)
    if cuda == "tf32":
        assert change is None and after == before  # already allowed: nothing touched
        return
    assert change is not None
    assert change.settings["torch.backends.cuda.matmul.fp32_precision"] == (cuda, "tf32")
    change.undo()
    assert _views() == before


_CUDNN_STARTS = list(itertools.product([True, False], [UNSET, "ieee", "tf32"], [UNSET, "ieee", "tf32"]))


@needs_new_api
@pytest.mark.parametrize(
    ("legacy", "conv", "rnn"), _CUDNN_STARTS, ids=[f"{a}-{b}-{c}" for a, b, c in _CUDNN_STARTS]
)
def test_cudnn_tf32_is_set_in_every_view_that_was_readable_then_put_back_exactly(
    legacy: bool, conv: str, rnn: str
) -> None:
    cudnn = torch.backends.cudnn
    cudnn.allow_tf32 = legacy
    cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = conv, rnn
    before = _views()
    change = tf32.allow_cudnn()
    after = _views()
    assert (after["cudnn.conv.fp32_precision"], after["cudnn.rnn.fp32_precision"]) == ("tf32", "tf32")
    if before["cudnn.allow_tf32"] != RAISES:
        assert after["cudnn.allow_tf32"] is True
    matmul = ("get_float32_matmul_precision", "cuda.matmul.fp32_precision", "mkldnn.matmul.fp32_precision")
    assert all(after[k] == before[k] for k in matmul)
    if (conv, rnn) == ("tf32", "tf32"):
        assert change is None and after == before
        return
    assert change is not None and all(old != new for old, new in change.settings.values())
    change.undo()
    assert _views() == before


def test_torch_without_the_per_operation_settings_uses_the_older_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch before 2.9: only set_float32_matmul_precision and cudnn.allow_tf32 (the rest hidden here)."""
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace())  # no fp32_precision
    cudnn = SimpleNamespace(allow_tf32=False)  # no conv/rnn settings
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("highest")
        matmul = tf32.allow_matmul()
        assert matmul is not None and torch.get_float32_matmul_precision() == "high"
        assert matmul.settings == {"torch.set_float32_matmul_precision": ("highest", "high")}
        matmul.undo()
        assert torch.get_float32_matmul_precision() == "highest"
        torch.set_float32_matmul_precision("medium")
        assert tf32.allow_matmul() is None  # faster than TF32 already: left alone
        torch.set_float32_matmul_precision("highest")
    convolutions = tf32.allow_cudnn()
    assert convolutions is not None and cudnn.allow_tf32 is True
    convolutions.undo()
    assert cudnn.allow_tf32 is False
    cudnn.allow_tf32 = True
    assert tf32.allow_cudnn() is None


@needs_new_api
def test_the_readers_say_tf32_is_on_exactly_where_allowing_it_changes_nothing() -> None:
    """matmul_allowed/cudnn_allowed (what profile_steps' TF32 advice reads) agree with allow_*: from every
    start state, "on" exactly where allow_* has nothing to change, and "on" after it, as before after undo."""
    cudnn = torch.backends.cudnn
    for legacy, cuda, cpu in _MATMUL_STARTS:
        torch.set_float32_matmul_precision(legacy)
        torch.backends.cuda.matmul.fp32_precision = cuda
        torch.backends.mkldnn.matmul.fp32_precision = cpu
        was = tf32.matmul_allowed()
        change = tf32.allow_matmul()
        assert was is (change is None) and tf32.matmul_allowed(), (legacy, cuda, cpu)
        if change is not None:
            change.undo()
        assert tf32.matmul_allowed() is was
    for legacy_cudnn, conv, rnn in _CUDNN_STARTS:
        cudnn.allow_tf32 = legacy_cudnn
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = conv, rnn
        was = tf32.cudnn_allowed()
        change = tf32.allow_cudnn()
        assert was is (change is None) and tf32.cudnn_allowed(), (legacy_cudnn, conv, rnn)
        if change is not None:
            change.undo()
        assert tf32.cudnn_allowed() is was


@needs_new_api
def test_torch_29s_notice_on_the_older_calls_is_dropped_and_other_warnings_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.set_float32_matmul_precision

    def noisy(precision: str) -> None:  # what torch 2.9 does on its older calls, plus an unrelated warning
        warnings.warn(
            "Please use the new API settings to control TF32 behavior ... Please see https://pytorch.org/docs/"
            "main/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices",
            UserWarning,
            stacklevel=2,
        )
        warnings.warn("something else", UserWarning, stacklevel=2)
        real(precision)

    monkeypatch.setattr(torch, "set_float32_matmul_precision", noisy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        change = tf32.allow_matmul()
        assert change is not None
        change.undo()
    assert [str(w.message) for w in caught] == ["something else", "something else"]


# ------------------------------------------------------------------------------ the switch, on a pretend GPU
@pytest.mark.usefixtures("ampere")
def test_on_an_ampere_gpu_every_flag_is_set_then_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _views()
    switch = fast_kernels(tf32=True, cudnn_benchmark=True)
    after = _views()
    assert after["cudnn.benchmark"] is True
    assert after["get_float32_matmul_precision"] == "high" and after["cuda.matmul.allow_tf32"] is True
    assert after["cudnn.allow_tf32"] is True
    assert switch.changed["torch.backends.cudnn.benchmark"] == (False, True)
    assert switch.active and switch.not_applied == {}
    assert "TF32 for cuDNN" in switch.already  # torch's default allows it already
    if NEW_API:
        assert after["cuda.matmul.fp32_precision"] == "tf32"
        assert switch.changed["torch.backends.cuda.matmul.fp32_precision"] == (UNSET, "tf32")
    assert "set torch.backends.cudnn.benchmark: False -> True" in repr(switch)
    switch.restore()
    assert _views() == before and not switch.active
    switch.restore()  # a second restore does nothing
    assert _views() == before


@needs_new_api
@pytest.mark.usefixtures("ampere")
def test_flags_that_were_not_torchs_defaults_come_back_as_they_were() -> None:
    cudnn = torch.backends.cudnn
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # explicitly full fp32
    cudnn.conv.fp32_precision = "ieee"  # TF32 convolutions turned off (torch's default is on)
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # oneDNN's: the older view now refuses to read
    before = _views()
    assert before["get_float32_matmul_precision"] == RAISES and before["cudnn.allow_tf32"] == RAISES
    with fast_kernels(tf32=True, cudnn_benchmark=False) as switch:
        after = _views()
        assert after["cuda.matmul.fp32_precision"] == after["cudnn.conv.fp32_precision"] == "tf32"
        assert after["mkldnn.matmul.fp32_precision"] == "bf16" and after["cudnn.benchmark"] is False
        assert switch.changed["torch.backends.cudnn.conv.fp32_precision"] == ("ieee", "tf32")
        assert "torch.backends.cudnn.rnn.fp32_precision" not in switch.changed  # it was tf32 already
    assert _views() == before


@pytest.mark.usefixtures("ampere")
def test_what_is_already_on_is_left_alone_and_not_undone() -> None:
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    before = _views()
    with fast_kernels() as switch:
        assert switch.changed == {} and _views() == before
        assert {"TF32 for fp32 matmuls", "TF32 for cuDNN", "torch.backends.cudnn.benchmark"} <= set(
            switch.already
        )
    assert _views() == before
    assert torch.backends.cudnn.benchmark is True  # not "restored" to torch's default


@pytest.mark.usefixtures("ampere")
def test_before_ampere_tf32_auto_is_left_with_one_warning_and_true_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 0))
    before = _views()
    with pytest.warns(
        SpeedupsWarning, match=r"tf32: TF32 needs .* 8\.0 \(Ampere\) or later; this device: cuda:0 is 7\.0"
    ) as rec:
        switch = fast_kernels()
    assert len(rec) == 1 and "tf32" in switch.not_applied and "cudnn_benchmark" not in switch.not_applied
    assert (
        _views()["cudnn.benchmark"] is True
        and _views()["get_float32_matmul_precision"] == before["get_float32_matmul_precision"]
    )
    switch.restore()
    with pytest.raises(SpeedupsError, match=r"tf32=True cannot apply here: .* is 7\.0\. Pass tf32='auto'"):
        fast_kernels(tf32=True)
    assert _views() == before


@pytest.mark.usefixtures("ampere")
def test_cudnn_autotuning_is_kept_off_under_deterministic_algorithms_set_by_hand() -> None:
    torch.use_deterministic_algorithms(True)
    with pytest.warns(
        SpeedupsWarning, match=r"cudnn_benchmark: torch\.use_deterministic_algorithms\(True\) is on"
    ):
        switch = fast_kernels(tf32=False)
    assert torch.backends.cudnn.benchmark is False and switch.changed == {}
    switch.restore()
    with pytest.raises(
        SpeedupsError, match=r"cudnn_benchmark=True cannot apply here: .*Pass cudnn_benchmark='auto'"
    ):
        fast_kernels(tf32=False, cudnn_benchmark=True)


# --------------------------------------------------------------------------- the switch, on this CPU for real
@pytest.mark.usefixtures("cpu")
def test_on_a_cpu_auto_leaves_the_flags_with_one_warning_that_says_why() -> None:
    before = _views()
    with pytest.warns(
        SpeedupsWarning,
        match=r"do not apply here: tf32: .*this device: cpu; cudnn_benchmark: cuDNN runs on CUDA devices",
    ) as rec:
        switch = fast_kernels()
    assert len(rec) == 1 and "tf32=False, cudnn_benchmark=False to silence" in str(rec[0].message)
    assert _views() == before and switch.changed == {} and switch.active
    assert set(switch.not_applied) == {"tf32", "cudnn_benchmark"}
    assert "not applicable here: tf32: TF32 runs on NVIDIA GPUs" in repr(switch)
    switch.restore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked off: nothing to say
        fast_kernels(tf32=False, cudnn_benchmark=False).restore()


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("name", ["tf32", "cudnn_benchmark"])
def test_on_a_cpu_an_explicit_true_is_refused_before_anything_changes(name: str) -> None:
    model, before = _net(), _views()
    layouts = _layouts(model)
    with pytest.raises(
        SpeedupsError, match=rf"{name}=True cannot apply here: .*this device: cpu\. Pass {name}='auto'"
    ):
        fast_kernels(model, **{name: True})
    assert _views() == before and _layouts(model) == layouts


# ---------------------------------------------------------------------------------------------- channels_last
def test_convolutions_turn_channels_last_and_back_with_the_same_outputs() -> None:
    model, plain = _net(), _net()
    x = torch.randn(4, 3, 16, 16)
    model(x).sum().backward()  # gradients exist: they follow their weights
    first = [p for p in model.parameters()]
    layouts, expected = _layouts(model), plain(x)
    switch = fast_kernels(model, tf32=False, cudnn_benchmark=False)
    assert switch.convolutions == 2  # the 3x3 conv and the transposed conv; the 1x1 kernel needs nothing
    assert switch.changed == {"channels_last": (torch.contiguous_format, CL)}
    assert model[0].weight.is_contiguous(memory_format=CL) and not model[0].weight.is_contiguous()
    assert model[4].weight.is_contiguous(memory_format=CL) and model[0].weight.grad.is_contiguous(
        memory_format=CL
    )
    assert [
        p for p in model.parameters()
    ] == first  # the same Parameters: an optimizer made before still holds them
    # CPU convolutions in NHWC add in another order: equal within a few float32 roundings (seen: 3e-8)
    for inputs in (x, x.to(memory_format=CL)):
        torch.testing.assert_close(model(inputs), expected, rtol=1e-5, atol=1e-6)
    assert "set channels_last (2 convolutions)" in repr(switch)
    switch.restore()
    assert _layouts(model) == layouts
    assert torch.equal(model(x), expected)  # bit for bit the plain model again
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def test_only_contiguous_2d_convolution_weights_are_converted_and_exactly_those_are_put_back() -> None:
    model = nn.Sequential(
        nn.Conv1d(2, 2, 3), nn.Conv3d(2, 2, 3), nn.Conv2d(2, 4, 3), nn.Conv2d(4, 4, 3), nn.Linear(3, 3)
    )
    model[3].to(memory_format=CL)  # already channels_last: the user's, left so after restore
    layouts = _layouts(model)
    with fast_kernels(model, tf32=False, cudnn_benchmark=False) as switch:
        assert switch.convolutions == 1 and model[2].weight.is_contiguous(memory_format=CL)
        assert (
            model[1].weight.is_contiguous() and model[0].weight.is_contiguous()
        )  # Conv3d, Conv1d as they were
        assert "1 convolution in channels_last" in switch.already
    assert _layouts(model) == layouts and not model[3].weight.is_contiguous()


def test_nested_switches_keep_their_own_state_and_restore_innermost_first(ampere: None) -> None:
    model, before = _net(), _views()
    layouts = _layouts(model)
    with fast_kernels() as outer:
        on = _views()
        with fast_kernels(model) as inner:
            assert inner.convolutions == 2 and "torch.backends.cudnn.benchmark" not in inner.changed
            with fast_kernels(model) as innermost:  # the same model again: nothing left to convert
                assert innermost.convolutions == 0 and innermost.changed == {}
            assert not model[0].weight.is_contiguous()
        assert _views() == on and _layouts(model) == layouts  # the inner one put back only its own
        assert outer.active and kernel_switches.find("fast_kernels") is outer
    assert _views() == before and kernel_switches.find("fast_kernels") is None


def test_restoring_out_of_order_is_refused_before_anything_changes(ampere: None) -> None:
    model, before = _net(), _views()
    layouts = _layouts(model)
    outer = fast_kernels(cudnn_benchmark=True, tf32=False)
    inner = fast_kernels(model, tf32=True)
    inside, inside_layouts = _views(), _layouts(model)
    with pytest.raises(
        SpeedupsError,
        match=r"^fast_kernels\(None, tf32=False, .*\)\.restore\(\), on the one made at .* \(older\): the "
        r"one made at .* \(newer\), fast_kernels\(Sequential\(\.\.\.\), tf32=True, .*\), is still in "
        r"force\..*newest first",
    ):
        outer.restore()
    assert _views() == inside and _layouts(model) == inside_layouts and outer.active
    inner.restore()
    outer.restore()
    assert _views() == before and _layouts(model) == layouts


def test_an_out_of_order_restore_names_each_switch_by_where_it_was_made_and_its_order() -> None:
    """Two switches made alike read the same: each is named by the user's file:line that made it and by its
    order, in the refusal and in the order to restore them."""
    here = os.path.relpath(__file__)
    off = {"tf32": False, "cudnn_benchmark": False, "channels_last": False}
    outer, outer_at = fast_kernels(**off), f"{here}:{sys._getframe().f_lineno}"
    inner, inner_at = fast_kernels(**off), f"{here}:{sys._getframe().f_lineno}"
    with pytest.raises(SpeedupsError) as refused:
        outer.restore()
    said = "fast_kernels(None, tf32=False, cudnn_benchmark=False, channels_last=False, enabled=True)"
    assert str(refused.value).startswith(
        f"{said}.restore(), on the one made at {outer_at} (older): the one made at {inner_at} (newer), "
        f"{said}, is still in force. "
    )
    assert str(refused.value).endswith(f"the one made at {inner_at} (its restore(), or the end of its with "
                                       f"block), then the one made at {outer_at}.")  # fmt: skip
    assert outer.active and inner.active
    inner.restore()
    outer.restore()


def test_used_as_a_decorator_it_is_refused_and_leaves_nothing_changed() -> None:
    model, before = _net(), _views()
    layouts = _layouts(model)
    with pytest.raises(
        TypeError,
        match=r"^@fast_kernels\(Sequential\(\.\.\.\), .*\) on .*train: a switch is not a decorator\..*is put "
        r"back\. Write it inside the function: with fast_kernels\(model\): \.\.\.$",
    ):

        @fast_kernels(model, tf32=False, cudnn_benchmark=False)
        def train() -> None:
            pass

    assert _views() == before and _layouts(model) == layouts
    assert kernel_switches.find("fast_kernels") is None
    with pytest.raises(TypeError, match=r"^@fast_kernels on .*train: fast_kernels is a switch, not a"):

        @fast_kernels  # type: ignore[arg-type]
        def train() -> None:
            pass

    assert _views() == before


def test_with_on_a_restored_switch_is_refused() -> None:
    switch = fast_kernels(_net(), tf32=False, cudnn_benchmark=False)
    switch.restore()
    with (
        pytest.raises(SpeedupsError, match=r"already restored.*Make a new one: with fast_kernels\(model\)"),
        switch,
    ):
        pass


# ---------------------------------------------------------------- optimizer state follows its weights' layout
_OPTIMIZERS = [
    ("Adam", {"fused": True}),
    ("Adam", {"foreach": True}),
    ("Adam", {"foreach": False}),
    ("AdamW", {"fused": True, "amsgrad": True}),
    ("SGD", {"momentum": 0.9, "fused": True}),
    ("SGD", {"momentum": 0.9}),
    ("Adagrad", {"fused": True}),
    ("RMSprop", {"momentum": 0.9}),
]


def _conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    )


def _state_layouts(opt: torch.optim.Optimizer) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(weight strides, state tensor strides) of every state tensor of a 4-d weight's shape."""
    return [
        (p.stride(), v.stride())
        for p, state in opt.state.items()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape and p.dim() == 4
    ]


def _fit(name: str, options: dict, switching: str | None) -> tuple[list[torch.Tensor], list[tuple]]:
    """6 steps of a conv net; ``switching``: None (the plain loop), "with state" (fast_kernels after 2
    steps, restored after 4) or "before state" (fast_kernels before the first step, restored after 3: the
    field case). The weights after, and each step's (weight strides, state strides) pairs."""
    model = _conv_net()
    x, y = torch.randn(4, 3, 10, 10), torch.randn(4, 2)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **options)
    held = [p for group in opt.param_groups for p in group["params"]]
    on, off = {"with state": (2, 4), "before state": (0, 3)}.get(switching or "", (-1, -1))
    switch, layouts = None, []
    for i in range(6):
        if i == on:
            switch = fast_kernels(model, tf32=False, cudnn_benchmark=False)
            assert switch.convolutions == 2
            layouts += _state_layouts(opt)  # state made before the switch follows its weights at once
        if i == off:
            assert switch is not None
            switch.restore()
            assert all(p.is_contiguous() for p in model.parameters())
            layouts += _state_layouts(opt)  # and back
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        layouts += _state_layouts(opt)
    assert held == list(model.parameters())  # the optimizer still holds the model's own Parameters
    return [p.detach().clone() for p in model.parameters()], layouts


@pytest.mark.parametrize("switching", ["with state", "before state"])
@pytest.mark.parametrize(
    ("name", "options"),
    # fused Adam in the quick loop, the other implementations with the slow tests
    [pytest.param(n, o, id=f"{n}-{o}", marks=[] if i == 0 else [pytest.mark.slow])
     for i, (n, o) in enumerate(_OPTIMIZERS)],
)  # fmt: skip
def test_optimizer_state_follows_its_weights_there_and_back_and_training_matches_the_plain_loop(
    name: str, options: dict, switching: str
) -> None:
    """A fused step pairs a weight and its state element by element in memory order: state left in the other
    layout was 0.046 off (Adam, restore() mid-run). Every state tensor of a weight's shape has its weight's
    strides at every step; the weights end as the plain loop's, to the float rounding of NHWC convolutions on
    this CPU (seen: 6e-8)."""
    want, _ = _fit(name, options, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # not under test
        got, layouts = _fit(name, options, switching)
    assert layouts and all(weight == state for weight, state in layouts)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_state_is_moved_exactly_and_counted_and_parameters_stay_the_same_objects() -> None:
    """The layout change moves values without computing: bitwise the state before. The model's Parameters
    stay the optimizer's, also where torch.__future__ asks nn.Module.to for new ones."""
    model = _conv_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    model(torch.randn(2, 3, 10, 10)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    weights = [model[0].weight, model[2].weight]
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        switch = fast_kernels(model, tf32=False, cudnn_benchmark=False)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    assert [model[0].weight, model[2].weight] == weights and opt.param_groups[0]["params"][0] is weights[0]
    assert switch.optimizer_state == 4  # exp_avg and exp_avg_sq of two weights; the step counters are not
    assert "(2 convolutions, 4 optimizer state tensors)" in repr(switch)
    state = opt.state[model[0].weight]
    assert state["exp_avg"].is_contiguous(memory_format=CL) and not state["exp_avg"].is_contiguous()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    switch.restore()
    assert state["exp_avg"].is_contiguous() and all(torch.equal(state[k], v) for k, v in before.items())
    assert model[0].weight.grad is not None and model[0].weight.grad.is_contiguous()


# -------------------------------------------------------------------------------- deterministic, both orders
@pytest.mark.usefixtures("cublas_set")
def test_fast_kernels_inside_deterministic_is_refused_before_anything_changes() -> None:
    model = _net()
    layouts = _layouts(model)
    with deterministic(seed=0):
        made_at = f"{os.path.relpath(__file__)}:{sys._getframe().f_lineno - 1}"
        inside = _views()
        with pytest.raises(
            SpeedupsError,
            match=rf"the deterministic\(seed=0\) made at {made_at} is in force, and fast kernels undo "
            r"it.*switch\.restore\(\)",
        ):
            fast_kernels(model, tf32=False, cudnn_benchmark=False)
        assert _views() == inside and _layouts(model) == layouts
    fast_kernels(model, tf32=False, cudnn_benchmark=False).restore()  # allowed once restored


@pytest.mark.usefixtures("cublas_set")
def test_deterministic_inside_fast_kernels_is_refused_before_anything_changes() -> None:
    with fast_kernels(_net(), tf32=False, cudnn_benchmark=False):
        made_at = f"{os.path.relpath(__file__)}:{sys._getframe().f_lineno - 1}"
        inside, rng = _views(), torch.get_rng_state()
        with pytest.raises(
            SpeedupsError,
            match=rf"the fast_kernels\(\.\.\.\) made at {made_at} is in force.*switch\.restore\(\).*then "
            r"deterministic\(seed=3\)",
        ):
            deterministic(seed=3)
        assert _views() == inside and torch.equal(torch.get_rng_state(), rng)
        deterministic(seed=3, enabled=False)  # a switch that is off conflicts with nothing
    with deterministic(seed=3):  # allowed once restored
        pass


# -------------------------------------------------------------------------------------- off, and bad input
@pytest.mark.usefixtures("cublas_set")
def test_enabled_false_changes_nothing_anywhere() -> None:
    model, before = _net(), _views()
    layouts = _layouts(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fast_kernels(
            model, tf32=True, cudnn_benchmark=True, enabled=False
        ) as switch:  # True: not checked when off
            assert _views() == before and _layouts(model) == layouts
            with deterministic(seed=0):  # an off switch is not in force
                pass
    assert not switch.active and switch.changed == {} and "off" in repr(switch)
    switch.restore()
    assert _views() == before


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": 3}, TypeError, r"fast_kernels\(3, .*\): model=3: expected a torch.nn.Module or None"),
        ({"model": torch.ones(2)}, TypeError, r"model=tensor\(\[1\., 1\.\]\): expected a torch.nn.Module"),
        ({"tf32": "yes"}, ValueError, r"tf32='yes': expected True, False or 'auto'. Write tf32='auto'"),
        ({"cudnn_benchmark": 1}, TypeError, r"cudnn_benchmark=1: expected True, False or 'auto'"),
        ({"channels_last": None}, TypeError, r"channels_last=None: expected True, False or 'auto'"),
        ({"enabled": None}, TypeError, r"enabled=None: expected True or False"),
        ({"channels_last": True}, ValueError, r"channels_last=True converts a .*fast_kernels\(model\)"),
        ({"model": nn.Linear(2, 2), "channels_last": True}, ValueError, r"Linear has none .*=False"),
        ({"model": nn.DataParallel(_net())}, ValueError, r"in DataParallel.*: fast_kernels\(model\), then"),
    ],
    ids=["int model", "tensor model", "tf32 string", "benchmark int", "channels_last None", "enabled None",
         "channels_last without a model", "channels_last without convolutions", "wrapped model"],
)  # fmt: skip
def test_bad_arguments_raise_before_anything_changes(kwargs: dict, error: type, match: str) -> None:
    model = kwargs.get("model")
    layouts = _layouts(model) if isinstance(model, nn.Module) else None
    before = _views()
    with pytest.raises(error, match=match):
        fast_kernels(**{"tf32": False, "cudnn_benchmark": False, **kwargs})
    assert _views() == before and kernel_switches.find("fast_kernels") is None
    if layouts is not None:
        assert _layouts(model) == layouts


def test_the_model_inside_a_live_data_parallel_wrapper_is_refused_before_anything_changes() -> None:
    """ddp_wrap(model) first, then fast_kernels(model): the wrapper does not follow the weights' new
    layout (under DDP on 2 ranks, 0.08 off the plain loop after a restore() mid-run: tests/seams)."""
    model = _net()
    wrapper = nn.DataParallel(model)  # a live wrapper of the same parameters (DDP alike, off a process group)
    layouts, before = _layouts(model), _views()
    with pytest.raises(
        ValueError,
        match=r"already wrapped in a DataParallel.*fast_kernels\(model\), then "
        r"ddp_wrap\(model\)",
    ):
        fast_kernels(model, tf32=False, cudnn_benchmark=False)
    assert _layouts(model) == layouts and _views() == before and kernel_switches.find("fast_kernels") is None
    del wrapper
    gc.collect()
    switch = fast_kernels(model, tf32=False, cudnn_benchmark=False)  # the wrapper gone: accepted
    assert switch.convolutions > 0
    switch.restore()


def test_a_model_without_convolutions_under_auto_is_said_once() -> None:
    with pytest.warns(SpeedupsWarning, match=r"channels_last: Linear has no 2-d convolutions") as rec:
        switch = fast_kernels(nn.Linear(2, 2), tf32=False, cudnn_benchmark=False)
    assert len(rec) == 1 and switch.convolutions == 0 and switch.changed == {}
    switch.restore()


def test_mixed_precision_auto_staying_in_fp32_names_fast_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(
        SpeedupsWarning, match=r"staying in fp32.*speedups\.fast_kernels\(model\) turns on TF32"
    ):
        mixed_precision(device_type="cpu")


# ------------------------------------------------------------------------------------------------ CUDA only
@pytest.mark.cuda
def test_on_a_real_gpu_the_switch_sets_and_restores_and_convolutions_stay_close() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ampere = torch.cuda.get_device_capability(device) >= (8, 0)
    model, plain = _net().to(device), _net().to(device)
    x = torch.randn(8, 3, 32, 32, device=device)
    expected = plain(x)
    before = _views()
    with warnings.catch_warnings(record=True) as caught:  # what the switch itself says
        warnings.simplefilter("always")
        switch = fast_kernels(model, tf32=ampere or "auto")
    got = model(x.to(memory_format=CL))
    assert torch.backends.cudnn.benchmark is True and switch.convolutions == 2
    if ampere:  # both views agree and can be read (inductor reads the older ones)
        assert _views()["get_float32_matmul_precision"] == "high" and _views()["cudnn.allow_tf32"] is True
        assert _views()["cuda.matmul.allow_tf32"] is True
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        switch.restore()
    torch_said = [w for w in caught + more if not issubclass(w.category, SpeedupsWarning)]
    assert not torch_said, [str(w.message) for w in torch_said]  # no TF32 notice from torch, on any version
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # TF32: 10-bit mantissa products
    assert _views() == before
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
