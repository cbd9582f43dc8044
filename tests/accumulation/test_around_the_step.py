"""What real loops do around the step, against hand-written PyTorch: two steps sharing one fp16
mixed_precision (a GAN), several optimizers in one window, per-update hooks (EMA), the gradient norm,
zero_grad left in the loop, and fused optimizers skipping an fp16 step."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import SpeedupsWarning, UpdateRecord, accumulate, mixed_precision
from tests._models import linear_data, mlp, reference_step, total_norm, twin


# ------------------------------------------------------------------------------ a GAN with one amp object
def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(2, 4), nn.Linear(4, 1)


def _gan_data(n: int = 6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    real = [torch.randn(8, 4, generator=g) for _ in range(n)]
    real[0] = real[0] * 1e4  # the discriminator's first window overflows in fp16
    return real, [torch.randn(8, 2, generator=g) for _ in range(n)]


def _d_loss(G: nn.Module, D: nn.Module, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    lr, lf = D(real), D(G(z).detach())
    return F.binary_cross_entropy_with_logits(lr, torch.ones_like(lr)) + F.binary_cross_entropy_with_logits(
        lf, torch.zeros_like(lf)
    )


def _g_loss(G: nn.Module, D: nn.Module, z: torch.Tensor) -> torch.Tensor:
    D.requires_grad_(False)
    try:
        out = D(G(z))
        return F.binary_cross_entropy_with_logits(out, torch.ones_like(out))
    finally:
        D.requires_grad_(True)


def _flat(*modules: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for m in modules for p in m.parameters()])


def test_two_steps_sharing_one_fp16_mixed_precision_equal_one_grad_scaler_per_optimizer() -> None:
    every, n = 2, 6
    real, z = _gan_data(n)
    # PyTorch's AMP recipe: a GradScaler per optimizer, each stepped and updated at its own boundaries.
    G, D = _gan()
    og, od = torch.optim.Adam(G.parameters(), 1e-2), torch.optim.Adam(D.parameters(), 1e-2)
    sd, sg = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    d_taken = 0
    for i in range(n):
        with torch.autocast("cpu", dtype=torch.float16):
            ld = _d_loss(G, D, real[i], z[i])
        sd.scale(ld / every).backward()
        if i % every == every - 1:
            before = sd.get_scale()
            sd.step(od)
            sd.update()
            od.zero_grad()
            d_taken += sd.get_scale() >= before
        with torch.autocast("cpu", dtype=torch.float16):
            lg = _g_loss(G, D, z[i])
        sg.scale(lg / every).backward()
        if i % every == every - 1:
            sg.step(og)
            sg.update()
            og.zero_grad()
    assert d_taken == 2  # the reference skipped D's first window and no other
    ref_g, ref_d = _flat(G), _flat(D)

    G, D = _gan()
    og, od = torch.optim.Adam(G.parameters(), 1e-2), torch.optim.Adam(D.parameters(), 1e-2)
    amp = mixed_precision("fp16", device_type="cpu")

    @accumulate(every, od)
    @amp
    def d_step(real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return _d_loss(G, D, real, z)

    @accumulate(every, og)
    @amp
    def g_step(z: torch.Tensor) -> torch.Tensor:
        return _g_loss(G, D, z)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)
        for i in range(n):
            d_step(real[i], z[i])
            g_step(z[i])
    assert (d_step.num_updates, g_step.num_updates) == (2, 3)
    assert d_step.scaler is amp.scaler and g_step.scaler is not amp.scaler  # one loss scale per step
    assert g_step.scaler.get_scale() == sg.get_scale() and d_step.scaler.get_scale() == sd.get_scale()
    assert torch.equal(_flat(G), ref_g) and torch.equal(_flat(D), ref_d)


# -------------------------------------------------------------------------- several optimizers, one window
class _BackboneHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = mlp(3, 8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def _two_optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, list]:
    backbone = torch.optim.AdamW(model.backbone.parameters(), lr=1e-2, weight_decay=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    step_lr = torch.optim.lr_scheduler.StepLR
    schedulers = [step_lr(backbone, 1, 0.5), step_lr(head, 2, 0.5)]
    return backbone, head, schedulers


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_two_optimizers_in_one_window_equal_the_hand_written_loop(max_grad_norm: float | None) -> None:
    X, Y = linear_data(44)
    torch.manual_seed(3)
    model = _BackboneHead()
    ref = copy.deepcopy(model)
    opt_b, opt_h, scheds = _two_optimizers(model)
    ref_b, ref_h, ref_scheds = _two_optimizers(ref)
    norms: list[torch.Tensor] = []

    @accumulate(4, [opt_b, opt_h], scheduler=scheds, max_grad_norm=max_grad_norm, model=model)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    for x, y in train_step.epoch([(X[i : i + 4], Y[i : i + 4]) for i in range(0, 44, 4)]):
        train_step(x, y)
    for start, stop in [(0, 16), (16, 32), (32, 44)]:  # windows of 4, 4 and a flushed 3
        ref_b.zero_grad()
        ref_h.zero_grad()
        F.mse_loss(ref(X[start:stop]), Y[start:stop]).backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm))
        ref_b.step()
        ref_h.step()
        for sched in ref_scheds:
            sched.step()
    assert train_step.num_updates == 3
    assert [s.last_epoch for s in scheds] == [3, 3]
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    if max_grad_norm is not None:
        assert norms[-1] > max_grad_norm  # the clip was active
        torch.testing.assert_close(train_step.last_grad_norm, norms[-1], atol=1e-6, rtol=1e-5)
    else:
        assert train_step.last_grad_norm is None  # no norm computed: no cost


def test_fp16_overflow_in_one_optimizers_gradients_skips_every_optimizer() -> None:
    torch.manual_seed(0)
    model = _BackboneHead()
    opt_b, opt_h, scheds = _two_optimizers(model)
    before = [p.detach().clone() for p in model.parameters()]
    overflow = [True]

    @accumulate(2, [opt_b, opt_h], scheduler=scheds)
    @mixed_precision("fp16", device_type="cpu")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        out = model(x).float().pow(2).mean()
        return out * 1e30 if overflow[0] else out  # inf only in the first window

    train_step(torch.ones(4, 3))
    train_step(torch.ones(4, 3))
    assert train_step.last_step_skipped and train_step.num_updates == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # neither moved
    assert [s.last_epoch for s in scheds] == [0, 0] and train_step.scaler.get_scale() == 2.0**15
    overflow[0] = False
    train_step(torch.ones(4, 3))
    train_step(torch.ones(4, 3))
    assert not train_step.last_step_skipped and train_step.num_updates == 1
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def _other_scheduler() -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters()), 1)


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda m, o: ([],), ValueError, r"optimizer=\[\]: expected at least one"),
        (lambda m, o: ([o, o],), ValueError, r"the same optimizer is listed twice"),
        (
            lambda m, o: ([o, torch.optim.SGD(m.parameters(), lr=0.1)],),
            ValueError,
            r"optimizer\[1\] \(SGD, counted from 0\) holds a parameter an earlier one holds too",
        ),
        (lambda m, o: ([o, "adam"],), TypeError, r"got a list of str"),
        (lambda m, o: (o, [o]), TypeError, r"scheduler=.*holds an optimizer \(SGD\).* step twice"),
        (
            lambda m, o: (o, [_other_scheduler()]),
            ValueError,
            r"schedules another optimizer than this step's",
        ),
    ],
)
def test_bad_optimizer_lists_are_refused_at_decoration(make, error: type, pattern: str) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = make(model, opt)
    with pytest.raises(error, match=pattern):
        accumulate(2, args[0], scheduler=args[1] if len(args) > 1 else None)


# ------------------------------------------------------------------------------------------ on_update
def test_ema_through_on_update_is_exact_across_a_skipped_and_a_flushed_window() -> None:
    X, Y = linear_data(40)
    Y[8:12] = float("nan")  # the third call's loss is NaN: the first window is skipped (skip_nonfinite)
    model, opt, ref, ref_opt = twin()
    swa = torch.optim.swa_utils
    ema = swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    ref_ema = swa.AveragedModel(ref, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    records: list[UpdateRecord] = []

    @accumulate(4, opt, skip_nonfinite=True)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    handle = train_step.on_update(lambda record: ema.update_parameters(model))
    train_step.on_update(records.append)
    with pytest.warns(SpeedupsWarning, match="NaN or inf"):
        for x, y in train_step.epoch([(X[i : i + 4], Y[i : i + 4]) for i in range(0, 40, 4)]):  # 4 + 4 + 2
            train_step(x, y)
    # Hand-written: the first window is skipped (no step, no EMA), then the window of 4 and the flushed 2.
    for start, stop in [(16, 32), (32, 40)]:
        reference_step(ref_opt, F.mse_loss(ref(X[start:stop]), Y[start:stop]))
        ref_ema.update_parameters(ref)
    assert train_step.num_updates == 2 and [r.num_updates for r in records] == [1, 2]
    assert [(r.step, r.micro_steps) for r in records] == [(8, 4), (10, 2)]
    # The window means differ from the big batch's in the last bits only; a missed or extra EMA update would
    # move the average by about 1e-2.
    torch.testing.assert_close(list(ema.parameters()), list(ref_ema.parameters()), atol=1e-7, rtol=0)
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-7, rtol=0)
    handle.remove()
    train_step(X[:4], Y[:4])
    train_step.flush()
    assert len(records) == 3 and ema.n_averaged.item() == 2  # the removed hook no longer runs


def test_the_update_record_holds_the_windows_loss_items_norm_and_learning_rates() -> None:
    X, Y = linear_data(12)
    model, opt, ref, _ = twin()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    sizes = [5, 3, 4]
    records: list[UpdateRecord] = []

    @accumulate(3, opt, scheduler=sched, max_grad_norm=100.0, model=model)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.mse_loss(model(x), y, reduction="sum") / len(y), len(y)

    train_step.on_update(records.append)
    offsets = [0, 5, 8, 12]
    for a, b in itertools.pairwise(offsets):
        train_step(X[a:b], Y[a:b])
    (record,) = records
    loss = F.mse_loss(ref(X), Y)  # the item-weighted mean of the window is the mean over its 12 rows
    loss.backward()
    norm = total_norm([p.grad for p in ref.parameters()])
    assert record.num_items == sum(sizes) and record.micro_steps == 3 and record.lrs == [0.1]
    torch.testing.assert_close(record.loss, loss.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(record.grad_norm, norm, atol=1e-6, rtol=1e-6)
    assert record.loss.grad_fn is None and opt.param_groups[0]["lr"] == 0.05  # read before the scheduler


def test_on_update_refuses_what_it_cannot_call() -> None:
    model, opt, _, _ = twin()
    train_step = accumulate(2, opt)(lambda x: model(x).sum())
    for wrong in ("log", lambda: None, lambda a, b: None):  # refused when registered, not at the update
        with pytest.raises(TypeError, match=r"on_update\(.*expected a function of one argument"):
            train_step.on_update(wrong)


# --------------------------------------------------------------------------------------- gradient norm
def test_the_clip_norm_sums_in_model_order_bit_for_bit_like_clip_grad_norm() -> None:
    """nanoGPT's optimizer groups (2-D weights, then the rest) are not the model's order."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups, lr=1e-3)

    model, opt = build()
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    norms = []
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    expected = [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    train_step = accumulate(1, opt, max_grad_norm=0.5, model=model)(lambda x, y: F.mse_loss(model(x), y))
    got = []
    for _ in range(3):
        train_step(x, y)
        got.append(train_step.last_grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(got, norms, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected, strict=True))


# ------------------------------------------------------------------------------------- zero_grad by hand
@pytest.mark.parametrize("who", ["optimizer", "model"])
def test_zero_grad_left_in_the_loop_is_warned_once(who: str) -> None:
    model, opt, _, _ = twin()
    train_step = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            (opt if who == "optimizer" else model).zero_grad(set_to_none=True)
            train_step(torch.ones(2, 3))
    said = [w for w in caught if issubclass(w.category, SpeedupsWarning)]
    assert len(said) == 1 and "zero_grad() call" in str(said[0].message)
    assert said[0].filename == __file__  # points at the loop


def test_a_loop_without_zero_grad_and_a_resumed_window_never_warn() -> None:
    model, opt, _, _ = twin()
    train_step = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    for _ in range(6):
        train_step(torch.ones(2, 3))  # SpeedupsWarning is an error in the test suite
    state = copy.deepcopy(train_step.state_dict())
    fresh, fresh_opt, _, _ = twin()
    resumed = accumulate(4, fresh_opt)(lambda x: fresh(x).pow(2).mean())
    resumed.load_state_dict(state)
    for _ in range(6):
        resumed(torch.ones(2, 3))
    assert resumed.num_updates == 3


# --------------------------------------------------------------------------------------- fused optimizers
@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_a_skipped_fp16_step_is_a_skip_for_fused_and_foreach_optimizers(kind: str) -> None:
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, **options)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = model.weight.detach().clone()

    @accumulate(1, opt, scheduler=sched)
    @mixed_precision("fp16", device_type="cpu")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        return model(x).float().pow(2).mean() * float("inf")

    train_step(torch.randn(8, 4))
    assert train_step.last_step_skipped and train_step.num_updates == 0
    assert opt.param_groups[0]["lr"] == 0.1 and torch.equal(model.weight, before)

    amp = mixed_precision("fp16", device_type="cpu")
    with amp:
        loss = model(torch.randn(8, 4)).float().pow(2).mean() * float("inf")
    amp.backward(loss)
    assert amp.step(opt) is False and amp.last_step_skipped and torch.equal(model.weight, before)


@pytest.mark.parametrize("where", ["call", "flush", "micro-batched call"])
def test_a_skipped_window_is_warned_at_the_line_of_the_users_loop(where: str) -> None:
    model, opt, _, _ = twin()
    micro = 2 if where == "micro-batched call" else None
    train_step = accumulate(2, opt, skip_nonfinite=True, micro_batch_size=micro)(
        lambda x: model(x).pow(2).mean() * float("nan")
    )
    with pytest.warns(SpeedupsWarning, match="NaN or inf") as record:
        train_step(torch.ones(4, 3))
        if where == "flush":
            train_step.flush()
        else:
            train_step(torch.ones(4, 3))
    assert [w.filename for w in record] == [__file__]
