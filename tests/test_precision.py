"""mixed_precision against fp32 and hand-written GradScaler references; composition with @accumulate."""

from __future__ import annotations

import copy
import itertools
import re
import sys
import threading
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from speedups import SpeedupsError, SpeedupsWarning
from speedups import precision as precision_module
from speedups._helpers import hardware as _hardware
from speedups.accumulation import accumulate
from speedups.precision import mixed_precision
from tests._bench import run_quick
from tests._models import mlp, total_norm


def _mlp(seed: int = 0) -> torch.nn.Module:
    return mlp(16, 32, 1, activation=torch.nn.ReLU, seed=seed)


def _data(n: int = 40, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g) * scale


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)))
    den = torch.sqrt(sum((y**2).sum() for y in b))
    return float(num / den)


def test_bf16_on_cpu_autocasts_the_forward_only() -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    X, Y = _data(64)
    amp = mixed_precision("bf16", device_type="cpu")
    assert amp.scaler is None and amp.dtype == torch.bfloat16
    with amp:
        hidden = model[0](X)
        loss = F.mse_loss(model(X), Y)
    assert hidden.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    amp.backward(loss)  # no scaler: exactly loss.backward()
    F.mse_loss(ref(X), Y).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    grads = [p.grad for p in model.parameters()]
    ref_grads = [p.grad for p in ref.parameters()]
    assert 0 < _rel(grads, ref_grads) < 2e-2  # close, and really computed in bf16


def test_bf16_stacked_under_accumulate_uses_no_scaler() -> None:
    model = _mlp()
    X, Y = _data(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[torch.dtype] = []

    @accumulate(2, opt)
    @mixed_precision("bf16", device_type="cpu")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        seen.append(out.dtype)
        return F.mse_loss(out, y)

    for i in range(0, 16, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
    assert seen == [torch.bfloat16] * 4 and train_step.scaler is None and train_step.num_updates == 2


@pytest.mark.parametrize("spelling", ["stacked", "inside"])
def test_fp16_accumulate_clip_unscales_once_per_step(spelling: str) -> None:
    X, Y = _data(40, scale=10.0)  # large targets: the clip is active
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step_norms: list[float] = []
    opt.register_step_pre_hook(
        lambda o, *_: step_norms.append(float(total_norm([p.grad for p in model.parameters()])))
    )
    # GradScaler's default first scale (2**16) overflows twice on this problem and skips 2 of the 3 steps
    # while it calibrates; from 2**10 on, no step overflows, so the run can be compared with fp32.
    amp = mixed_precision("fp16", device_type="cpu", init_scale=2.0**10)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if spelling == "stacked":
            return F.mse_loss(model(x), y)
        with mixed_precision("fp16", device_type="cpu", init_scale=2.0**10):  # a fresh object on every call
            return F.mse_loss(model(x), y)

    fn = amp(loss_of) if spelling == "stacked" else loss_of
    train_step = accumulate(4, opt, max_grad_norm=1.0)(fn)
    scalers = []
    real_unscale = torch.amp.GradScaler.unscale_
    with mock.patch.object(
        torch.amp.GradScaler, "unscale_", autospec=True, side_effect=real_unscale
    ) as unscale:
        for i in range(0, 40, 4):
            train_step(X[i : i + 4], Y[i : i + 4])
            scalers.append(train_step.scaler)
        train_step.flush()  # no "unscale_() has already been called" anywhere
    assert scalers[0] is not None and all(s is scalers[0] for s in scalers)  # one scaler for the whole run
    if spelling == "stacked":
        assert scalers[0] is amp.scaler
    assert unscale.call_count == 3 and train_step.num_updates == 3 and len(step_norms) == 3
    assert max(step_norms) <= 1.0 + 1e-6  # unscaled units: the clip ran after the one unscale

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    clipped = []
    for start, stop in [(0, 16), (16, 32), (32, 40)]:
        ref_opt.zero_grad()
        F.mse_loss(ref(X[start:stop]), Y[start:stop]).backward()
        clipped.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)) > 1.0)
        ref_opt.step()
    assert all(clipped)
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-3, rtol=0)


def test_fp16_with_num_items_keeps_the_scalers_headroom() -> None:
    """Backward on loss * num_items would multiply the fp16 gradients by the count and overflow at a loss
    scale that a plain mean loss fits in; the step weighs relative to the window's first count instead."""
    X, Y = _data(40, scale=10.0)
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)

    @accumulate(2, opt)
    @mixed_precision("fp16", device_type="cpu", init_scale=2.0**10)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.mse_loss(model(x), y), len(y)

    bounds = [0, 8, 13, 20, 24, 33, 40]
    for a, b in itertools.pairwise(bounds):
        train_step(X[a:b], Y[a:b])
    for a, b in [(0, 13), (13, 24), (24, 40)]:  # windows of 8+5, 7+4 and 9+7 samples
        ref_opt.zero_grad()
        F.mse_loss(ref(X[a:b]), Y[a:b]).backward()
        ref_opt.step()
    assert train_step.num_updates == 3  # no step lost to an overflow
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-3, rtol=0)


def test_forced_overflow_skips_the_optimizer_and_the_scheduler() -> None:
    X, Y = _data(16)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    factor = [1.0]

    @accumulate(2, opt, scheduler=sched)
    @mixed_precision("fp16", device_type="cpu")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y) * factor[0]

    train_step(X[:4], Y[:4])
    train_step(X[4:8], Y[4:8])
    assert train_step.num_updates == 1 and sched.last_epoch == 1 and not train_step.last_step_skipped
    before = [p.detach().clone() for p in model.parameters()]
    scale_before = train_step.scaler.get_scale()  # type: ignore[union-attr]
    factor[0] = float("inf")
    train_step(X[:4], Y[:4])
    train_step(X[4:8], Y[4:8])  # no warning: a skipped fp16 step is how loss scaling calibrates
    assert train_step.last_step_skipped and bool(train_step.found_inf)
    assert train_step.num_updates == 1 and sched.last_epoch == 1  # neither stepped
    torch.testing.assert_close(list(model.parameters()), before, atol=0, rtol=0)
    assert train_step.scaler.get_scale() == scale_before / 2  # type: ignore[union-attr]


def test_standalone_fp16_equals_the_pytorch_amp_recipe() -> None:
    X, Y = _data(40, scale=10.0)
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    amp = mixed_precision("fp16", device_type="cpu", init_scale=2.0**10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i in range(0, 40, 8):
        opt.zero_grad()
        with amp:
            loss = F.mse_loss(model(X[i : i + 8]), Y[i : i + 8])
        amp.backward(loss)
        assert amp.step(opt, max_grad_norm=1.0) and not amp.last_step_skipped
        assert not bool(amp.found_inf)

        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = F.mse_loss(ref(X[i : i + 8]), Y[i : i + 8])
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)
    assert amp.scaler is not None and amp.scaler.get_scale() == scaler.get_scale()
    with amp:
        loss = F.mse_loss(model(X[:8]), Y[:8]) * float("inf")
    amp.backward(loss)
    assert amp.step(opt) is False and amp.last_step_skipped


def test_state_dict_carries_the_scaler() -> None:
    amp = mixed_precision("fp16", device_type="cpu", init_scale=1024.0)
    assert amp.scaler is not None
    state = amp.state_dict()
    other = mixed_precision("fp16", device_type="cpu")
    other.load_state_dict(state)
    assert other.scaler is not None and other.scaler.get_scale() == 1024.0
    with pytest.raises(ValueError, match=r"has a GradScaler \(fp16\).*mixed_precision\('fp16'\)"):
        mixed_precision("bf16", device_type="cpu").load_state_dict(state)
    with pytest.raises(ValueError, match=r"keys \['dtype', 'scaler'\]"):
        other.load_state_dict({"scale": 1.0})


def test_nesting_and_threads_each_get_their_own_entry() -> None:
    amp = mixed_precision("bf16", device_type="cpu")
    lin = torch.nn.Linear(4, 4)
    with amp:
        with amp:
            assert lin(torch.ones(1, 4)).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")  # the outer entry is still open
    assert not torch.is_autocast_enabled("cpu")

    barrier = threading.Barrier(2)
    seen: dict[int, tuple[torch.dtype, bool]] = {}

    def worker(i: int) -> None:
        with amp:
            barrier.wait(timeout=10)  # both threads inside the same object at once
            out = lin(torch.ones(1, 4))
            barrier.wait(timeout=10)
        seen[i] = (out.dtype, torch.is_autocast_enabled("cpu"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert seen == {0: (torch.bfloat16, False), 1: (torch.bfloat16, False)}


def test_decorator_keeps_signature_and_rejects_classes() -> None:
    import inspect

    amp = mixed_precision("bf16", device_type="cpu")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        @amp
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    assert Net()(torch.ones(1, 4)).dtype == torch.bfloat16
    assert list(inspect.signature(Net.forward).parameters) == ["self", "x"]
    with pytest.raises(TypeError, match=r"cannot decorate a class\. Decorate its method"):
        amp(Net)


def test_enabled_false_is_a_true_no_op() -> None:
    amp = mixed_precision("fp16", device_type="cpu", enabled=False)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    assert amp(f) is f and amp.scaler is None and not amp.enabled
    lin = torch.nn.Linear(4, 1)
    with amp:
        assert not torch.is_autocast_enabled("cpu")
        loss = lin(torch.ones(2, 4)).sum()
    amp.backward(loss)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    assert amp.step(opt) is True and amp.found_inf is None


def test_auto_on_a_cpu_without_native_bf16_stays_fp32_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(SpeedupsWarning, match=r"no native bf16.*staying in fp32") as record:
        amp = mixed_precision(device_type="cpu")
    assert len(record) == 1 and amp.dtype is None and not amp.enabled and amp.scaler is None
    with amp:
        assert not torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: True)
    amp = mixed_precision(device_type="cpu")
    assert amp.dtype == torch.bfloat16 and amp.scaler is None


def test_cpu_capability_check_reads_the_flags() -> None:
    assert _hardware.bf16_in_cpuinfo("flags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert _hardware.bf16_in_cpuinfo("flags : fpu amx_bf16 amx_tile\n")
    assert _hardware.bf16_in_cpuinfo("Features\t: fp asimd bf16 i8mm\n")  # Arm
    assert not _hardware.bf16_in_cpuinfo("flags\t\t: fpu sse avx2 avx512f\n")
    assert not _hardware.bf16_in_cpuinfo("")


def test_cpu_capability_check_agrees_with_torch_on_this_machine() -> None:
    is_avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if sys.platform != "linux" or is_avx512_bf16 is None or is_amx is None:
        pytest.skip("torch's own x86 capability probes are not available here")
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    assert _hardware.cpu_has_native_bf16() == bool(is_avx512_bf16() or is_amx())


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"dtype": "fp8"}, ValueError, r"mixed_precision\('fp8'\): unknown dtype\. Allowed: 'auto', 'bf16'"),
        ({"dtype": torch.float32}, ValueError, r"mixed_precision\(torch\.float32\).*not 16-bit"),
        ({"dtype": torch.float64}, ValueError, r"mixed_precision\(torch\.float64\).*not 16-bit"),
        ({"dtype": torch.int8}, ValueError, r"mixed_precision\(torch\.int8\).*Allowed: 'auto'"),
        ({"dtype": 16}, TypeError, r"mixed_precision\(16\): expected a string or a torch\.dtype"),
        ({"dtype": "bf16", "device_type": "gpu"}, ValueError, r"device_type='gpu'\): not a device type"),
        ({"dtype": "bf16", "device_type": "meta"}, ValueError, r"device_type='meta'\): not a device type"),
        ({"dtype": "bf16", "device_type": 0}, TypeError, r"device_type=0\): expected a device type string"),
        ({"enabled": "yes"}, TypeError, r"mixed_precision\('auto'\): enabled='yes': expected True or False"),
        (
            {"dtype": "fp16", "init_scale": 0},
            ValueError,
            r"mixed_precision\('fp16'\): init_scale=0: must be a positive finite number\. "
            r"Write init_scale=2\.0\*\*16\.",
        ),
    ],
)
def test_bad_input_raises(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        mixed_precision(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_a_gpu_is_a_speedups_error() -> None:
    with pytest.raises(SpeedupsError, match=r"no cuda device.*device_type=None"):
        mixed_precision("fp16", device_type="cuda")


def test_scaler_arriving_mid_window_is_an_error() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    use_amp = [False]

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        if use_amp[0]:
            with mixed_precision("fp16", device_type="cpu"):
                return model(x).sum()
        return model(x).sum()

    train_step = accumulate(4, opt)(loss_of)
    train_step(torch.ones(2, 16))
    use_amp[0] = True
    with pytest.raises(SpeedupsError, match="GradScaler arrived in the middle of an accumulation window"):
        train_step(torch.ones(2, 16))
    assert train_step.pending == 1 and not torch.is_autocast_enabled("cpu")


def test_backward_inside_an_accumulate_step_is_an_error() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = mixed_precision("bf16", device_type="cpu")

    @accumulate(2, opt)
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        amp.backward(loss)
        return loss

    with pytest.raises(SpeedupsError, match="runs backward itself"):
        train_step(torch.ones(2, 16))


@pytest.mark.slow
def test_benchmark_quick_mode_prints_its_table() -> None:
    stdout = run_quick("precision")
    assert re.search(r"fp32\s+[\d.]+ s\s+1\.000x", stdout), stdout
    assert re.search(r"auto \(\w+\)\s+[\d.]+ s\s+[\d.]+x", stdout), stdout


def _half_run(dtype: str, device: str, skipped: list[bool] | None = None) -> tuple[Any, ...]:
    """@accumulate(4) with clipping over @mixed_precision(dtype) on 40 rows of scale-10 targets (micro-batches
    of 4, windows 16, 16, 8). Returns (model, its twin before training, the twin's SGD, X, Y, the autocast
    dtypes seen, the step); ``skipped`` collects each optimizer step's ``last_step_skipped``."""
    X, Y = (t.to(device) for t in _data(40, scale=10.0))
    model = _mlp().to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    seen: list[torch.dtype] = []

    @accumulate(4, opt, max_grad_norm=1.0)
    @mixed_precision(dtype, device_type=device)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model[0](x)
        seen.append(out.dtype)
        return F.mse_loss(model[2](model[1](out)), y)

    for i in range(0, 40, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
        if skipped is not None and train_step.is_boundary:
            skipped.append(train_step.last_step_skipped)
    train_step.flush()
    if skipped is not None:
        skipped.append(train_step.last_step_skipped)
    return model, ref, ref_opt, X, Y, seen, train_step


def _fp16_accumulate_against_grad_scaler(device: str) -> None:
    """fp16 under @accumulate(4) with clipping equals the PyTorch AMP recipe written by hand: the same
    GradScaler at the same scale skips the same optimizer steps (targets of scale 10 overflow fp16 at the
    default 2**16 scale: a GPU skips those steps too) and the weights after them agree."""
    skipped: list[bool] = []
    model, ref, ref_opt, X, Y, seen, train_step = _half_run("fp16", device, skipped)

    scaler = torch.amp.GradScaler(device)  # the AMP recipe: scale, unscale_, clip, step, update
    ref_skipped = []
    for start, stop in [(0, 16), (16, 32), (32, 40)]:
        ref_opt.zero_grad()
        micro = range(start, stop, 4)
        for i in micro:
            with torch.autocast(device, dtype=torch.float16):
                loss = F.mse_loss(ref(X[i : i + 4]), Y[i : i + 4]) / len(micro)
            scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_skipped.append(scaler.get_scale() < before)
    assert set(seen) == {torch.float16}
    assert skipped == ref_skipped and any(skipped)  # overflow at 2**16: both skip the same steps
    assert train_step.scaler.get_scale() == scaler.get_scale()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-5, rtol=1e-5)


def test_fp16_accumulate_skips_what_the_amp_recipe_skips_cpu() -> None:
    _fp16_accumulate_against_grad_scaler("cpu")


@pytest.mark.cuda
def test_cuda_fp16_accumulate_skips_what_the_amp_recipe_skips() -> None:
    _fp16_accumulate_against_grad_scaler("cuda")


@pytest.mark.cuda
def test_cuda_bf16_with_accumulate() -> None:
    if not _hardware.gpu_has_native_bf16():
        pytest.skip("this GPU has no native bf16 (compute capability below 8.0)")
    model, ref, ref_opt, X, Y, seen, train_step = _half_run("bf16", "cuda")
    assert set(seen) == {torch.bfloat16} and train_step.scaler is None
    for start, stop in [(0, 16), (16, 32), (32, 40)]:
        ref_opt.zero_grad()
        F.mse_loss(ref(X[start:stop]), Y[start:stop]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=2e-2, rtol=0)


def test_auto_is_fp16_on_a_gpu_with_emulated_bf16_and_bf16_from_ampere_on() -> None:
    """A T4 (7.5) makes bf16 tensors (torch's default probe says supported) but computes them emulated."""
    for major, minor, want in [(7, 5, torch.float16), (7, 0, torch.float16), (8, 0, torch.bfloat16)]:
        card = mock.Mock(name="gpu", total_memory=16 * 2**30, major=major, minor=minor)
        card.name = f"stand-in {major}.{minor}"
        with mock.patch.multiple(
            torch.cuda,
            is_available=lambda: True,
            device_count=lambda: 1,
            current_device=lambda: 0,
            get_device_properties=lambda *_, card=card: card,
            is_bf16_supported=lambda *_, **__: True,
        ):
            amp = mixed_precision("auto", device_type="cuda")
            from speedups import doctor

            facts = doctor.diagnose()
        assert amp.dtype == want and (amp.scaler is not None) == (want == torch.float16), (major, minor)
        assert facts["gpus"][0]["bf16"] == (want == torch.bfloat16)  # the doctor says the same


@pytest.mark.cuda
def test_cuda_auto_picks_a_16_bit_dtype() -> None:
    amp = mixed_precision(device_type="cuda")
    expected = torch.bfloat16 if _hardware.gpu_has_native_bf16() else torch.float16
    assert amp.dtype == expected and (amp.scaler is not None) == (expected == torch.float16)


@pytest.mark.parametrize(
    ("norm", "error"), [(-1.0, ValueError), (float("nan"), ValueError), ("x", TypeError)]
)
def test_step_validates_max_grad_norm_before_touching_anything(norm, error) -> None:
    lin = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 1)).pow(2).sum().backward()
    before = lin.weight.detach().clone()
    with pytest.raises(error, match=r"mixed_precision.step\(optimizer, max_grad_norm="):
        mixed_precision("bf16", device_type="cpu").step(opt, max_grad_norm=norm)
    torch.testing.assert_close(lin.weight.detach(), before, atol=0, rtol=0)


def test_enabled_false_does_not_need_the_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    amp = mixed_precision("bf16", device_type="cuda", enabled=False)  # enabled=torch.cuda.is_available()
    assert not amp.enabled
    with amp:
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(SpeedupsError, match="no cuda device"):
        mixed_precision("bf16", device_type="cuda")


def test_decorating_a_generator_function_is_refused() -> None:
    def batches():
        yield torch.ones(1)

    with pytest.raises(TypeError, match="generator function"):
        mixed_precision("bf16", device_type="cpu")(batches)


def test_load_state_dict_rejects_a_scaler_state_that_is_not_one() -> None:
    amp = mixed_precision("fp16", device_type="cpu")
    good = amp.state_dict()
    with pytest.raises(ValueError, match="not a GradScaler state"):
        amp.load_state_dict({"dtype": 1, "scaler": {"a": 1}})
    amp.load_state_dict(good)
