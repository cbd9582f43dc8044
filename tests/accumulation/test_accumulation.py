"""@accumulate against hand-written big-batch references: normalisation, flush, DDP, resume, bad input."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from speedups import SpeedupsError, SpeedupsWarning
from speedups.accumulation import accumulate
from speedups.precision import mixed_precision
from tests._bench import run_quick
from tests._dist import FSDP2_REASON, HAS_FSDP2, WORKERS, run_torchrun
from tests._models import FakeFSDP2, linear_data, mlp, reference_step, twin
from tests._sync_counter import SyncCounter


def test_short_last_window_is_normalised_by_what_it_accumulated() -> None:
    X, Y = linear_data()
    model, opt, ref, ref_opt = twin()
    steps: list[int] = []
    opt.register_step_pre_hook(lambda *_: steps.append(1))

    @accumulate(4, opt)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    for i in range(0, 40, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
    train_step.flush()
    assert len(steps) == 3 and train_step.num_updates == 3 and train_step.step == 10
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())

    naive = copy.deepcopy(ref)
    naive_opt = torch.optim.SGD(naive.parameters(), lr=0.1)
    for start, stop in [(0, 16), (16, 32), (32, 40)]:  # windows of 4, 4 and 2 micro-batches
        reference_step(ref_opt, F.mse_loss(ref(X[start:stop]), Y[start:stop]))
        # the usual mistake: every window divided by 4, so the last one weighs half
        reference_step(naive_opt, F.mse_loss(naive(X[start:stop]), Y[start:stop], reduction="sum") / 16)
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)
    off = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), naive.parameters(), strict=True))
    assert off > 1e-3  # the reference can tell the two apart


def test_equal_windows_equal_the_big_batch_with_adam_and_scheduler() -> None:
    X, Y = linear_data(96)
    model = mlp(3, 8, 1, seed=1)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)

    @accumulate(3, opt, scheduler=sched)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    for i in range(0, 96, 8):  # 12 micro-batches of 8: 4 optimizer steps
        loss = train_step(X[i : i + 8], Y[i : i + 8])
        assert loss.grad_fn is None and loss.shape == ()
    for start in range(0, 96, 24):
        reference_step(ref_opt, F.mse_loss(ref(X[start : start + 24]), Y[start : start + 24]))
        ref_sched.step()
    assert train_step.num_updates == 4 and sched.last_epoch == 4
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=1e-5)


def _grads_at_step(opt: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(
        lambda o, *_: seen.append([p.grad.clone() for g in o.param_groups for p in g["params"]])
    )
    return seen


def test_num_items_unequal_sizes_give_the_big_batch_gradient() -> None:
    X, Y = linear_data(29)
    model, opt, ref, _ = twin()
    seen = _grads_at_step(opt)

    @accumulate(4, opt)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.mse_loss(model(x), y), len(y)

    bounds = [0, 8, 16, 24, 29]
    for a, b in itertools.pairwise(bounds):
        loss, n = train_step(X[a:b], Y[a:b])
        assert n == b - a and loss.grad_fn is None
    F.mse_loss(ref(X), Y).backward()  # mean over the 29 samples
    torch.testing.assert_close(seen[0], [p.grad for p in ref.parameters()], atol=1e-6, rtol=0)


def test_num_items_token_counts_give_the_global_token_mean() -> None:
    g = torch.Generator().manual_seed(3)
    vocab, dim = 7, 5
    model, opt, ref, _ = twin(mlp(dim, vocab))
    seen = _grads_at_step(opt)
    # 3 micro-batches of 2 sequences of length 6, with very different numbers of real (non-padding) tokens
    feats = torch.randn(3, 2, 6, dim, generator=g)
    targets = torch.randint(0, vocab, (3, 2, 6), generator=g)
    lengths = torch.tensor([[6, 1], [2, 2], [5, 6]])
    mask = torch.arange(6) < lengths[..., None]

    @accumulate(3, opt)
    def train_step(x: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token_loss = F.cross_entropy(model(x).flatten(0, 1), t.flatten(), reduction="none")
        n_tokens = m.sum()  # a 0-dim tensor: stays on the device
        return (token_loss * m.flatten()).sum() / n_tokens, n_tokens

    for i in range(3):
        train_step(feats[i], targets[i], mask[i])
    token_loss = F.cross_entropy(ref(feats[mask]), targets[mask])  # mean over all 22 real tokens
    token_loss.backward()
    torch.testing.assert_close(seen[0], [p.grad for p in ref.parameters()], atol=1e-6, rtol=0)


def test_clipping_applies_once_to_the_normalised_gradient() -> None:
    X, Y = linear_data()
    Y = Y * 10  # large errors: the clip is active
    model, opt, ref, ref_opt = twin()

    @accumulate(4, opt, max_grad_norm=0.5)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    for epoch in range(2):
        for i in range(0, 40, 4):
            train_step(X[i : i + 4], Y[i : i + 4])
        train_step.flush()
        for start, stop in [(0, 16), (16, 32), (32, 40)]:
            ref_opt.zero_grad()
            F.mse_loss(ref(X[start:stop]), Y[start:stop]).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            assert norm > 0.5, epoch
            ref_opt.step()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)


def test_no_host_sync_by_default_and_one_per_boundary_with_skip_nonfinite() -> None:
    X, Y = linear_data()
    model, opt, _, _ = twin()
    plain = accumulate(4, opt)(lambda x, y: (F.mse_loss(model(x), y), len(y)))
    with SyncCounter() as counter:
        for i in range(8):
            plain(X[i : i + 4], Y[i : i + 4])
    assert counter.count == 0 and plain.num_updates == 2  # Python-number counts: sync-free
    # A device-tensor count: one sync per optimizer step (is the window empty?), none on other micro-steps.
    tensor_counts = accumulate(4, opt)(lambda x, y: (F.mse_loss(model(x), y), torch.tensor(float(len(y)))))
    _assert_one_sync_per_window_of_four(tensor_counts, X, Y)

    @accumulate(4, opt, skip_nonfinite=True)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.mse_loss(model(x), y), len(y)

    _assert_one_sync_per_window_of_four(train_step, X, Y)


def _assert_one_sync_per_window_of_four(step, X: torch.Tensor, Y: torch.Tensor) -> None:
    """No host-device sync on the first 3 micro-steps of an ``@accumulate(4)`` window, one on the 4th."""
    with SyncCounter() as counter:
        for i in range(3):
            step(X[i : i + 4], Y[i : i + 4])
    assert counter.count == 0 and step.pending == 3
    with SyncCounter() as counter:
        step(X[:4], Y[:4])
    assert counter.count == 1 and step.num_updates == 1


def test_skip_nonfinite_false_has_no_sync_and_leaves_nan_to_the_user() -> None:
    X, Y = linear_data()
    model, opt, _, _ = twin()
    scale = [1.0]
    train_step = accumulate(2, opt, skip_nonfinite=False)(lambda x, y: F.mse_loss(model(x), y) * scale[0])
    with SyncCounter() as counter:
        for i in range(0, 16, 4):
            train_step(X[i : i + 4], Y[i : i + 4])
    assert counter.count == 0 and train_step.num_updates == 2 and train_step.found_inf is None
    scale[0] = float("nan")
    train_step(X[:4], Y[:4])
    train_step(X[:4], Y[:4])  # like the plain loop: the step happens, the parameters become NaN
    assert train_step.num_updates == 3 and not train_step.last_step_skipped
    assert all(p.isnan().all() for p in model.parameters())


def test_multi_process_job_without_model_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.warns(SpeedupsWarning, match=r"no model= was given.*model=model\)"):
        accumulate(4, opt)
    monkeypatch.setenv("RANK", "1")  # rank 0 only
    accumulate(4, opt)


@pytest.mark.slow
def test_benchmark_quick_mode_prints_its_table() -> None:
    stdout = run_quick("accumulate")
    assert re.search(r"hand-written\s+[\d.]+ s\s+1\.000x", stdout), stdout
    assert re.search(r"@accumulate\s+[\d.]+ s\s+[\d.]+x", stdout), stdout
    assert re.search(r"preemption watching: StopOnSignal.requested\(\) [\d.]+ us per call, 1\.0\d+x", stdout)


def test_resume_mid_window_gives_the_same_weights_as_not_stopping() -> None:
    X, Y = linear_data(48)

    def run(stop_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def make_step(m: torch.nn.Module, o: torch.optim.Optimizer):
            return accumulate(4, o)(lambda x, y: (F.mse_loss(m(x), y), len(y)))

        train_step = make_step(model, opt)
        sizes = [4, 3, 4, 2, 4, 4, 3, 4, 4, 4, 4, 4]
        offset = 0
        for i, n in enumerate(sizes):
            if i == stop_at:
                ckpt = copy.deepcopy(
                    {"model": model.state_dict(), "opt": opt.state_dict(), "step": train_step.state_dict()}
                )
                assert ckpt["step"]["pending"] == stop_at % 4 != 0
                model = torch.nn.Linear(3, 1)  # a fresh process: new objects, loaded from the checkpoint
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
                train_step = make_step(model, opt)
                train_step.load_state_dict(ckpt["step"])
            train_step(X[offset : offset + n], Y[offset : offset + n])
            offset += n
        train_step.flush()
        assert train_step.step == len(sizes)
        return [p.detach().clone() for p in model.parameters()]

    straight = run(None)
    torch.testing.assert_close(run(6), straight, atol=1e-7, rtol=0)
    torch.testing.assert_close(run(9), straight, atol=1e-7, rtol=0)


def test_load_state_dict_rejects_another_window_size() -> None:
    model, opt, _, _ = twin()
    a = accumulate(4, opt)(lambda x: model(x).sum())
    b = accumulate(2, opt)(lambda x: model(x).sum())
    with pytest.raises(ValueError, match=r"accumulated over 4 .* accumulate\(4, \.\.\.\)"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"expected the dict of train_step\.state_dict"):
        b.load_state_dict({"step": 1})


def test_method_decoration_keeps_signature_and_shares_state() -> None:
    X, Y = linear_data()
    model, opt, ref, ref_opt = twin()

    class Trainer:
        def __init__(self, net: torch.nn.Module) -> None:
            self.net = net

        @accumulate(2, opt)
        def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            """Loss of one micro-batch."""
            return F.mse_loss(self.net(x), y)

    import inspect

    trainer = Trainer(model)
    assert list(inspect.signature(Trainer.train_step).parameters) == ["self", "x", "y"]
    assert Trainer.train_step.__doc__ == "Loss of one micro-batch."
    for i in range(0, 40, 4):
        trainer.train_step(X[i : i + 4], Y[i : i + 4])
        assert trainer.train_step.is_boundary == (i % 8 == 4)
    assert trainer.train_step.num_updates == Trainer.train_step.num_updates == 5
    trainer.train_step.flush()  # nothing pending: no-op
    assert trainer.train_step.num_updates == 5
    for start in range(0, 40, 8):
        reference_step(ref_opt, F.mse_loss(ref(X[start : start + 8]), Y[start : start + 8]))
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)


def test_enabled_false_is_a_plain_step_on_every_call() -> None:
    X, Y = linear_data()
    model, opt, ref, ref_opt = twin()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    train_step = accumulate(4, opt, scheduler=sched, enabled=False)(lambda x, y: F.mse_loss(model(x), y))
    for i in range(0, 40, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
        assert train_step.is_boundary and train_step.pending == 0
        reference_step(ref_opt, F.mse_loss(ref(X[i : i + 4]), Y[i : i + 4]))
        ref_sched.step()
    assert train_step.num_updates == 10
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)


def test_epoch_iterator_flushes_and_refuses_a_straddling_window() -> None:
    X, Y = linear_data()
    model, opt, _, _ = twin()
    train_step = accumulate(4, opt)(lambda x, y: F.mse_loss(model(x), y))
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 40, 4)]
    for x, y in train_step.epoch(batches):
        train_step(x, y)
    assert train_step.num_updates == 3 and train_step.pending == 0  # flushed at the end of the loader
    for x, y in train_step.epoch(batches):
        train_step(x, y)
        if train_step.pending == 2:
            break  # an epoch cut short without flush()
    with pytest.raises(SpeedupsError, match=r"2 micro-steps of an earlier epoch.*train_step\.flush\(\)"):
        next(iter(train_step.epoch(batches)))
    train_step.flush()
    assert train_step.num_updates == 4
    assert len(list(train_step.epoch(batches[:1]))) == 1


def test_nonfinite_loss_skips_the_window_and_the_scheduler_with_a_warning() -> None:
    X, Y = linear_data()
    model, opt, _, _ = twin()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scale = [1.0]
    train_step = accumulate(2, opt, scheduler=sched, skip_nonfinite=True)(
        lambda x, y: F.mse_loss(model(x), y) * scale[0]
    )
    before = [p.detach().clone() for p in model.parameters()]
    train_step(X[:4], Y[:4])
    scale[0] = float("inf")
    with pytest.warns(SpeedupsWarning, match="NaN or inf.*skipped"):
        train_step(X[4:8], Y[4:8])
    assert train_step.last_step_skipped and bool(train_step.found_inf)
    assert train_step.num_updates == 0 and sched.last_epoch == 0
    torch.testing.assert_close(list(model.parameters()), before, atol=0, rtol=0)
    assert all(p.grad is None for p in model.parameters())  # the bad window is dropped
    scale[0] = 1.0
    train_step(X[:4], Y[:4])
    train_step(X[4:8], Y[4:8])
    assert not train_step.last_step_skipped and train_step.num_updates == 1 and sched.last_epoch == 1


@pytest.mark.parametrize(
    ("every", "error", "pattern"),
    [
        (0, ValueError, r"accumulate\(0, optimizer, \.\.\.\): every=0: must be an int >= 1"),
        (-1, ValueError, r"accumulate\(-1, optimizer, \.\.\.\): every=-1: must be an int >= 1"),
        (2.5, TypeError, r"accumulate\(2\.5, optimizer, \.\.\.\): every=2\.5: expected an int >= 1"),
        ("4", TypeError, r"accumulate\('4', optimizer, \.\.\.\): every='4': expected an int >= 1"),
        (True, TypeError, r"accumulate\(True, optimizer, \.\.\.\): every=True: expected an int >= 1"),
    ],
)
def test_bad_every_is_rejected_at_decoration(every: object, error: type, pattern: str) -> None:
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(error, match=pattern):
        accumulate(every, opt)  # type: ignore[arg-type]


def test_bad_arguments_are_rejected_at_decoration() -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = r"optimizer=.*expected a torch.optim.Optimizer or a list of them, got a list of Parameter\. B"
    with pytest.raises(TypeError, match=expected):
        accumulate(4, list(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scheduler=.*step\(\)"):
        accumulate(4, opt, scheduler=0.5)
    with pytest.raises(ValueError, match=r"max_grad_norm=0.*positive"):
        accumulate(4, opt, max_grad_norm=0)
    with pytest.raises(TypeError, match=r"max_grad_norm='1'"):
        accumulate(4, opt, max_grad_norm="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model=.*torch.nn.Module"):
        accumulate(4, opt, model=opt)  # type: ignore[arg-type]
    swapped = r"accumulate\(SGD\(...\), 4\): the arguments are swapped.*accumulate\(4, opt"
    with pytest.raises(TypeError, match=swapped):
        accumulate(opt, 4)  # type: ignore[arg-type]


def test_a_scheduler_of_another_optimizer_is_refused_at_decoration() -> None:
    opt = twin().opt
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(
        ValueError, match=r"scheduler=StepLR: it schedules another optimizer.*StepLR\(optimizer"
    ):
        accumulate(2, opt, scheduler=sched)
    assert other.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda m, x: m(x), ValueError, r"loss of shape \(4, 1\).*return loss.mean\(\)"),
        (lambda m, x: m(x).sum().detach(), ValueError, "without grad_fn"),
        (lambda m, x: m(x).sum().item(), TypeError, "returned float"),
        (lambda m, x: "loss", TypeError, "returned str 'loss'"),
        (lambda m, x: (m(x).sum(), "4"), TypeError, "num_items='4'"),
        (lambda m, x: (m(x).sum(), -1), ValueError, "num_items=-1"),
        (lambda m, x: (m(x).sum(), 10**400), ValueError, "num_items=1000.*finite count >= 0"),
        (lambda m, x: (m(x).sum(), torch.ones(2)), ValueError, r"num_items of shape \(2,\)"),
    ],
)
def test_bad_step_results_raise_before_gradients_are_touched(make, error: type, pattern: str) -> None:
    model, opt, _, _ = twin()
    train_step = accumulate(2, opt)(lambda x: make(model, x))
    with pytest.raises(error, match=pattern):
        train_step(torch.ones(4, 3))
    assert all(p.grad is None for p in model.parameters())
    assert train_step.step == 0 and train_step.pending == 0


def test_switching_between_bare_loss_and_num_items_is_an_error() -> None:
    model, opt, _, _ = twin()
    with_items = [False]
    train_step = accumulate(4, opt)(lambda x: (model(x).sum(), 4) if with_items[0] else model(x).sum())
    train_step(torch.ones(4, 3))
    with_items[0] = True
    with pytest.raises(SpeedupsError, match=r"returned \(loss, num_items\) after returning a bare loss"):
        train_step(torch.ones(4, 3))
    assert train_step.pending == 1


def test_fsdp2_module_gets_gradient_sync_off_between_boundaries() -> None:
    X, Y = linear_data()
    torch.manual_seed(0)
    model, opt, ref, ref_opt = twin(FakeFSDP2())
    train_step = accumulate(3, opt, model=model)(lambda x, y: (F.mse_loss(model(x), y), len(y)))
    for i in range(0, 12, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
    assert model.sync_calls == [False, True]  # off for calls 1-2, back on for the boundary call
    reference_step(ref_opt, F.mse_loss(ref(X[:12]), Y[:12]))
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)
    train_step(X[:4], Y[:4])
    assert model.sync_calls == [False, True, False]
    with pytest.raises(SpeedupsError, match=r"FSDP2 .* drop_last=True"):
        train_step.flush()
    assert train_step.pending == 1
    state = train_step.state_dict()  # mid-window: the pending call, made again on resume (test_replay.py)
    assert state["grads"] is None and len(state["replay"]["calls"]) == 1


def test_fsdp2_epoch_syncs_its_last_call_so_the_short_window_flushes() -> None:
    X, Y = linear_data()
    model, opt, ref, ref_opt = twin(FakeFSDP2())
    train_step = accumulate(4, opt, model=model)(lambda x, y: F.mse_loss(model(x), y))
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 24, 4)]  # 6 calls: a window of 4, then 2
    for x, y in train_step.epoch(batches):
        train_step(x, y)
    assert model.sync_calls == [False, True, False, True]  # the 6th call, the epoch's last, synced
    assert train_step.num_updates == 2 and train_step.pending == 0
    for start, stop in [(0, 16), (16, 24)]:
        reference_step(ref_opt, F.mse_loss(ref(X[start:stop]), Y[start:stop]))
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)
    with pytest.raises(SpeedupsError, match=r"train_step.epoch\(loader\).*a loader with a length"):
        for x, y in train_step.epoch(iter(batches[:2])):  # no length: its last call cannot be known
            train_step(x, y)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["mean", "items"])
def test_ddp_equals_the_single_process_reference_with_one_all_reduce_per_step(mode: str) -> None:
    out = run_torchrun(WORKERS / "accumulate_ddp.py", [mode], nproc=2, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # the two ranks' lines may interleave on torchrun's stdout: match each record by its shape
    record = r"rank=\d to_ref=\S+ between_ranks=\S+ hook_calls=\d+ updates=\d+ grads_left=\d+"
    lines = sorted(re.findall(record, out.stdout))
    assert len(lines) == 2, out.stdout
    for line in lines:
        fields = dict(kv.split("=") for kv in line.split())
        assert float(fields["to_ref"]) < 1e-6, line  # equals the single-process big-batch reference
        assert float(fields["between_ranks"]) == 0.0, line  # flushed short windows: ranks identical
        # 2 epochs x (one full window of 3 + one flushed window of 2): 4 updates, of which only the two
        # full windows went through DDP's (hooked) all-reduce; every other call ran inside no_sync
        assert fields["hook_calls"] == "2" and fields["updates"] == "4" and fields["grads_left"] == "0", line


def test_a_window_of_zero_items_never_writes_nan() -> None:
    model, opt, _, _ = twin()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 3)
    step_host = accumulate(2, opt)(lambda n: (model(x).pow(2).mean(), n))
    step_host(0)
    with pytest.warns(SpeedupsWarning, match="0 items"):
        step_host(0)
    assert step_host.last_step_skipped and step_host.num_updates == 0
    torch.testing.assert_close(list(model.parameters()), before, atol=0, rtol=0)
    step_device = accumulate(1, opt)(lambda n: (model(x).pow(2).mean(), n))
    with pytest.warns(SpeedupsWarning, match="0 items"):  # a device count: the same rule, one sync
        step_device(torch.tensor(0))
    assert step_device.last_step_skipped and step_device.num_updates == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(list(model.parameters()), before, atol=0, rtol=0)  # SGD, no momentum


def test_load_state_dict_checks_everything_before_changing_anything() -> None:
    X, Y = linear_data()
    model, opt, _, _ = twin()
    train_step = accumulate(4, opt)(lambda x, y: F.mse_loss(model(x), y))
    train_step(X[:4], Y[:4])
    good = train_step.state_dict()
    grads = [p.grad.clone() for p in model.parameters()]
    bad_states = [
        {**good, "pending": "x"},
        {**good, "pending": 7},
        {**good, "mode": "garbage"},
        {**good, "grads": [torch.zeros(1, 3), torch.zeros(2)]},
        {**good, "grads": [torch.zeros(1, 3)]},
        {**good, "step": -1},
    ]
    for bad in bad_states:
        with pytest.raises(ValueError, match=r"load_state_dict\(state\)"):
            train_step.load_state_dict(bad)
        assert train_step.pending == 1 and train_step.step == 1
        torch.testing.assert_close([p.grad for p in model.parameters()], grads, atol=0, rtol=0)


@pytest.mark.parametrize("target", [None, 5, "f", type("Net", (), {})])
def test_decorating_something_that_is_not_a_step_function_raises(target) -> None:
    opt = twin().opt
    with pytest.raises(TypeError, match="expected the step function"):
        accumulate(2, opt)(target)


def test_a_one_element_loss_comes_back_0_dim() -> None:
    model, opt, _, _ = twin()
    train_step = accumulate(2, opt)(lambda: model(torch.ones(4, 3)).pow(2).mean().reshape(1, 1))
    assert train_step().shape == ()


@pytest.mark.parametrize("every", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_the_seeded_backward_gives_the_hand_written_gradients_bit_for_bit(every, dtype, shape) -> None:
    """The plain mean path backs ``loss`` up with the output gradient 1/N instead of building ``loss / N``."""
    model, opt, ref, ref_opt = twin(mlp(3, 5, 1).to(dtype))
    x, y = (t.to(dtype) for t in linear_data(4 * every))

    @accumulate(every, opt)
    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (model(xb) - yb).square().mean().reshape(shape)  # F.mse_loss has no bf16 CPU kernel on 2.4

    for i in range(2 * every):  # two windows
        xb, yb = x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]
        train_step(xb, yb)
        ((ref(xb) - yb).square().mean().reshape(shape) / every).backward()
        if (i + 1) % every:
            for got, want in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(got.grad, want.grad)
        else:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("through", ["clone", "view"])
def test_a_loss_that_hands_its_output_gradient_to_a_parameter_keeps_later_gradients_right(shape, through):
    """A loss that is a clone or a view of a parameter: autograd may make the output gradient its .grad."""
    w = torch.nn.Parameter(torch.full(shape, 2.0))
    opt = torch.optim.SGD([w], lr=0.1)
    train_step = accumulate(4, opt)(lambda: w.clone().sum() if through == "clone" else w.view(()))
    grads = []
    for _ in range(3):
        train_step()
        grads.append(w.grad.item())
    assert grads == [0.25, 0.5, 0.75]  # the steps' 1/4 each, summed: nothing added into a shared seed
    for _ in range(5):  # the rest of window 1, all of window 2
        train_step()
    assert w.item() == pytest.approx(2.0 - 0.1 - 0.1)


class _HalveGradInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.mul_(0.5)  # edits its input: legal for a custom backward, if discouraged


def test_a_backward_that_edits_its_output_gradient_in_place_matches_the_reference() -> None:
    model, opt, ref, ref_opt = twin()
    x, y = linear_data(16)
    train_step = accumulate(4, opt)(lambda xb, yb: _HalveGradInPlace.apply(F.mse_loss(model(xb), yb)))
    for i in range(8):
        train_step(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
        (_HalveGradInPlace.apply(F.mse_loss(ref(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2])) / 4).backward()
        if (i + 1) % 4 == 0:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------- the optimizer's guard
def _hand_stepping_loop(train_step, opt: torch.optim.Optimizer) -> None:
    for _ in range(8):
        train_step(torch.ones(4, 3))
        opt.step()  # the mistake: @accumulate already steps on every 4th call


@pytest.mark.parametrize("inside_check", [False, True])
def test_stepping_the_optimizer_by_hand_mid_window_warns_once(inside_check: bool) -> None:
    from speedups import check

    model, opt, _, _ = twin()
    train_step = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    pattern = r"optimizer\.step\(\) was called by hand .*after micro-step 1, 1 of 4 of the window"
    with contextlib.ExitStack() as stack:
        if inside_check:
            stack.enter_context(check())
        record = stack.enter_context(pytest.warns(SpeedupsWarning, match=pattern))
        _hand_stepping_loop(train_step, opt)
    hand = [w for w in record if "by hand" in str(w.message)]
    assert len(hand) == 1 and hand[0].filename == __file__  # once, pointing at the loop's optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        train_step(torch.ones(4, 3))
        opt.step()  # a second hand step: already said


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_steps_own_updates_and_flush_never_warn(dtype: str) -> None:

    model, opt, _, _ = twin()

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    fn = loss if dtype == "fp32" else mixed_precision("fp16", device_type="cpu", init_scale=2.0**10)(loss)
    train_step = accumulate(2, opt, max_grad_norm=1.0)(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        for x in train_step.epoch([torch.ones(4, 3)] * 5):
            train_step(x)
        opt.step()  # after the flush no window is open: nothing to break
    assert train_step.pending == 0 and (train_step.scaler is None) == (dtype == "fp32")
    assert train_step.num_updates == 3  # two full windows and the flushed one, all stepped


def test_the_guard_goes_with_the_step_and_enabled_false_sets_none() -> None:
    model, opt, _, _ = twin()
    assert not opt._optimizer_step_pre_hooks  # read here only, to see that nothing of ours is left
    accumulate(4, opt, enabled=False)(lambda x: model(x).pow(2).mean())
    assert not opt._optimizer_step_pre_hooks  # a plain step on every call: nothing to guard
    train_step = accumulate(4, opt)(lambda x: model(x).pow(2).mean())
    assert len(opt._optimizer_step_pre_hooks) == 1
    train_step(torch.ones(4, 3))
    del train_step
    gc.collect()
    assert not opt._optimizer_step_pre_hooks
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        opt.step()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not HAS_FSDP2, reason=FSDP2_REASON)
def test_fsdp2_windows_micro_batches_and_short_windows_equal_a_hand_written_fsdp2_loop(tmp_path) -> None:
    """2 gloo ranks: plain calls and micro_batch_size=2, each epoch ending on a flushed short window; a
    checkpoint taken mid-window is written and leaves the run as it was; "auto" is refused at decoration."""
    import json

    out = run_torchrun(WORKERS / "fsdp2_accumulate.py", [str(tmp_path)], nproc=2, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["auto_refused"] is True, result
        for name in ("plain", "micro"):
            assert result[name]["to_ref"] < 1e-6, (rank, name, result)
            assert result[name]["between"] == 0.0, (rank, name, result)
            assert result[name]["saved"] is True, (rank, name, result)


def test_accumulate_used_bare_without_an_optimizer_or_twice_says_how_to_write_it() -> None:
    model, opt, _, _ = twin()
    with pytest.raises(TypeError, match=r"@accumulate above step: .* Write @accumulate\(4, optimizer\)"):

        @accumulate
        def step(x: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

    with pytest.raises(TypeError, match=r"optimizer=None: accumulate needs the optimizer"):
        accumulate(4)
    inner = accumulate(2, opt)(lambda x: model(x).sum())
    for outer in (inner, mixed_precision("bf16", device_type="cpu")(inner)):
        with pytest.raises(TypeError, match=r"already an @accumulate step \(stacked twice\?\)"):
            accumulate(2, opt)(outer)
