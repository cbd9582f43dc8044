"""Micro-batching inside @accumulate: every split, fixed or found on (simulated) out of memory, equals the big
batch computed here in plain PyTorch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from speedups import accumulate
from speedups.accumulation.micro_batching import split_call
from tests._dist import WORKERS, run_torchrun
from tests._models import FakeFSDP2, linear_data, mlp, reference_step, twin

SIZES = [7, 5, 8, 3, 6]  # unequal batches; accumulate(2): two full windows and a flushed one
EVERY = 2


def _model() -> torch.nn.Sequential:
    return mlp(3, 8, 1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in SIZES:
        mask = torch.rand(n, generator=g) > 0.3  # items != rows: some rows are padding
        mask[0] = True
        out.append((torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g), mask))
    return out


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _reference(items: bool) -> torch.Tensor:
    """Plain PyTorch: one SGD step per window of whole calls (mean of call means, or per item)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches()
    for start in range(0, len(batches), EVERY):
        window = batches[start : start + EVERY]
        if items:
            num = sum(((model(x) - y).pow(2).squeeze(1) * m).sum() for x, y, m in window)
            loss = num / sum(m.sum() for _, _, m in window)
        else:
            loss = torch.stack([F.mse_loss(model(x), y) for x, y, _ in window]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _params(model)


def _train(micro_batch_size, *, items: bool, oom: str | None = None, limit: int = 3):
    """Train with accumulate(EVERY, micro_batch_size=...), raising OutOfMemoryError above ``limit`` rows."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = [0]

    def too_big(*_):
        if rows[0] > limit:
            raise torch.OutOfMemoryError(f"simulated: {rows[0]} rows > {limit}")

    if oom == "post-accumulate":  # fires after this .grad was added to: a backward failed half-way
        model[2].weight.register_post_accumulate_grad_hook(too_big)

    @accumulate(EVERY, opt, micro_batch_size=micro_batch_size)
    def train_step(x, y, mask):
        rows[0] = len(x)
        if oom == "forward":
            too_big()
        h = model[0](x)
        if oom == "backward":
            h.register_hook(too_big)  # a tensor hook raising in the middle of backward
        per_row = (model[2](model[1](h)) - y).pow(2).squeeze(1)
        if items:
            return per_row[mask].sum() / mask.sum(), mask.sum()
        return per_row.mean()

    losses = []
    for batch in train_step.epoch(_batches()):
        out = train_step(*batch)
        losses.append(out[0] if items else out)
    return _params(model), train_step, losses


@pytest.mark.parametrize("items", [False, True], ids=["mean", "num_items"])
@pytest.mark.parametrize(
    ("size", "oom"),
    [
        (None, None),
        (3, None),
        (100, None),
        ("auto", None),
        ("auto", "forward"),
        ("auto", "backward"),
        ("auto", "post-accumulate"),
    ],
)
def test_every_split_equals_the_big_batch(size, oom, items) -> None:
    params, train_step, losses = _train(size, items=items, oom=oom)
    torch.testing.assert_close(params, _reference(items), atol=1e-5, rtol=0)
    assert train_step.num_updates == 3
    # each call returns the whole batch's detached loss
    model = _model()
    x, y, mask = _batches()[0]
    per_row = (model(x) - y).pow(2).squeeze(1)
    first = per_row[mask].mean() if items else per_row.mean()
    torch.testing.assert_close(losses[0], first.detach(), atol=1e-6, rtol=0)
    assert all(not loss.requires_grad and loss.dim() == 0 for loss in losses)
    if oom is not None:
        assert train_step.micro_batch_size == 2  # 7 rows -> 4 (too big) -> 2, kept for later calls


def test_auto_starts_whole_and_halves_only_when_out_of_memory() -> None:
    _, train_step, _ = _train("auto", items=False, oom=None)
    assert train_step.micro_batch_size is None  # never needed to split
    _, train_step, _ = _train("auto", items=False, oom="forward", limit=4)
    assert train_step.micro_batch_size == 4  # 7 -> 4 fits
    _, fixed, _ = _train(3, items=False)
    assert fixed.micro_batch_size == 3


def test_auto_reraises_when_one_row_does_not_fit_and_puts_the_gradients_back() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fail = [False]

    @accumulate(2, opt, micro_batch_size="auto")
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        if fail[0]:
            loss.register_hook(lambda g: (_ for _ in ()).throw(torch.OutOfMemoryError("simulated")))
        return loss

    train_step(torch.randn(4, 3), torch.randn(4, 1))
    before = [p.grad.clone() for p in model.parameters()]
    fail[0] = True
    with pytest.raises(torch.OutOfMemoryError):
        train_step(torch.randn(4, 3), torch.randn(4, 1))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    assert train_step.step == 1 and train_step.pending == 1


def test_auto_reraises_other_errors_unchanged_with_the_gradients_put_back() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @accumulate(2, opt, micro_batch_size="auto")
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)  # adds to .grad, then fails: not out of memory
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        train_step(torch.randn(4, 3), torch.randn(4, 1))
    assert all(p.grad is None for p in model.parameters())
    assert train_step.micro_batch_size is None


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    name: str


def test_split_call_splits_nested_and_keyword_tensors_and_passes_the_rest_whole() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    args = ({"inputs": [x], "scale": torch.tensor(2.0)}, Batch(x, y, "b"))
    kwargs = {"targets": (y,), "tag": "t"}
    rows, pieces = split_call(args, kwargs, 2)
    assert rows == 5 and [r for r, _, _ in pieces] == [2, 2, 1]
    _, a, k = pieces[1]
    assert (
        torch.equal(a[0]["inputs"][0], x[2:4]) and torch.equal(a[1].x, x[2:4]) and torch.equal(a[1].y, y[2:4])
    )
    assert torch.equal(k["targets"][0], y[2:4]) and k["tag"] == "t" and a[1].name == "b"
    assert torch.equal(a[0]["scale"], torch.tensor(2.0))  # 0-dim: whole
    assert split_call(args, kwargs, 5)[1][0][1] is args  # fits: the call's own arguments, untouched


def _bad_step(opt, model, **kw):
    @accumulate(2, opt, micro_batch_size=2, **kw)
    def train_step(*args, **kwargs):
        return model(torch.ones(1, 3)).sum()

    return train_step


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, ">= 1"),
        (-3, ValueError, ">= 1"),
        ("big", ValueError, "'auto'"),
        (2.5, TypeError, "got float"),
        (True, TypeError, "got bool"),
    ],
)
def test_bad_micro_batch_size_is_refused_when_decorating(value, error, match) -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(error, match=rf"micro_batch_size={value!r}.*{match}.*micro_batch_size=\"auto\""):
        accumulate(2, opt, micro_batch_size=value)


def test_bad_split_is_refused_when_decorating() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="not callable"):
        accumulate(2, opt, micro_batch_size=2, split="rows")
    with pytest.raises(ValueError, match="only applies with micro_batch_size="):
        accumulate(2, opt, split=lambda a, k, s: [(a, k)])


def test_fsdp2_micro_batches_sync_only_the_last_of_a_boundary_call() -> None:
    """FSDP2 keeps unsynchronised gradients in its own buffers: a boundary call's last micro-batch syncs."""
    X, Y = linear_data(16)
    model, opt, ref, ref_opt = twin(FakeFSDP2())
    train_step = accumulate(2, opt, model=model, micro_batch_size=2)(lambda x, y: F.mse_loss(model(x), y))
    for i in range(0, 16, 4):
        train_step(X[i : i + 4], Y[i : i + 4])
    assert model.sync_calls == [
        False,
        True,
        False,
        True,
    ]  # per window: off for 3 micro-batches, on for the 4th
    for start in (0, 8):
        reference_step(ref_opt, F.mse_loss(ref(X[start : start + 8]), Y[start : start + 8]))
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s(["a", "b", "c"], 3), "no tensor with a batch dimension"),
        (lambda s: s(torch.ones(4, 3), torch.ones(3, 1)), r"4 rows .* shapes \[\(3, 1\)\]"),
        (lambda s: s(torch.ones(4, 3), weights=torch.ones(10)), r"shapes \[\(10,\)\]"),
    ],
)
def test_bad_batch_raises_before_any_backward(call, match) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        call(_bad_step(opt, model))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("split", "match"),
    [
        (lambda a, k, s: [((a[0][:2],), k)], r"\[2\] rows for a batch of 5"),  # rows 2-4 missing
        (lambda a, k, s: [((a[0][:3],), k), ((a[0][3:],), k)], r"\[3, 2\].*each with 1 to 2 rows"),
        (lambda a, k, s: [a[0][:2]], "expected \\(args, kwargs\\) pairs"),
    ],
)
def test_split_whose_pieces_do_not_cover_the_batch_raises_before_any_backward(split, match) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _bad_step(opt, model, split=split)
    with pytest.raises((ValueError, TypeError), match=match):
        step(torch.ones(5, 3))
    assert all(p.grad is None for p in model.parameters())


def test_split_callable_splits_an_rnn_hidden_state_along_dim_1_exactly() -> None:
    torch.manual_seed(0)
    rnn, head = torch.nn.GRU(3, 4, num_layers=2, batch_first=True), torch.nn.Linear(4, 1)
    params = [*rnn.parameters(), *head.parameters()]
    ref = [p.detach().clone().requires_grad_() for p in params]
    x, y, h0 = torch.randn(5, 6, 3), torch.randn(5, 1), torch.randn(2, 5, 4)  # h0: (layers, batch, hidden)

    def by_rows(args, kwargs, size):
        x, y, h = args
        return [
            ((x[i : i + size], y[i : i + size], h[:, i : i + size]), kwargs) for i in range(0, len(x), size)
        ]

    opt = torch.optim.SGD(params, lr=0.1)

    @accumulate(1, opt, micro_batch_size=2, split=by_rows)
    def train_step(x, y, h):
        out, h_n = rnn(x, h)
        return {"loss": F.mse_loss(head(out[:, -1]), y), "hidden": h_n.transpose(0, 1), "rows": len(x)}

    result = train_step(x, y, h0)
    # plain PyTorch on the whole batch with copies of the parameters
    ref_rnn, ref_head = torch.nn.GRU(3, 4, num_layers=2, batch_first=True), torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p, r in zip([*ref_rnn.parameters(), *ref_head.parameters()], ref, strict=True):
            p.copy_(r)
    out, h_n = ref_rnn(x, h0)
    loss = F.mse_loss(ref_head(out[:, -1]), y)
    ref_opt = torch.optim.SGD([*ref_rnn.parameters(), *ref_head.parameters()], lr=0.1)
    loss.backward()
    ref_opt.step()
    for p, r in zip(params, [*ref_rnn.parameters(), *ref_head.parameters()], strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(result["loss"], loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(result["hidden"], h_n.transpose(0, 1).detach(), atol=1e-6, rtol=0)
    assert result["rows"] == 1  # not a tensor: from the last micro-batch (5 rows = 2 + 2 + 1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("items", [False, True], ids=["mean", "num_items"])
def test_two_ranks_where_only_rank_0_runs_out_of_memory_equal_one_process(items) -> None:
    out = run_torchrun(WORKERS / "micro_batch_ddp.py", ["items" if items else "mean"], timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("rank")]
    assert len(lines) == 2, out.stdout
    for line in lines:
        fields = dict(kv.split("=") for kv in line.split()[1:])
        assert float(fields["to_ref"]) < 1e-5 and float(fields["between"]) == 0.0, line
        assert fields["hook_calls"] == "0" and fields["updates"] == "3", line  # DDP never synced on its own
    sizes = {line.split()[0]: dict(kv.split("=") for kv in line.split()[1:])["size"] for line in lines}
    assert sizes == {"rank0": "2", "rank1": "None"}, sizes  # only rank 0 had to split


@pytest.mark.parametrize("returned", [None, 3, torch.ones(5, 3), "pieces"])
def test_split_returning_no_list_of_pieces_raises_naming_split(returned) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _bad_step(opt, model, split=lambda a, k, s: returned)
    with pytest.raises(
        TypeError, match=r"split\(args, kwargs, 2\) returned .*expected a list of \(args, kwargs\)"
    ):
        step(torch.ones(5, 3))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("items", [False, True])
def test_a_call_failing_after_some_micro_backwards_drops_the_window_not_half_of_it(items) -> None:
    """Fixed micro_batch_size: the failed call's first micro-batches already summed into .grad. The window
    is closed (as a failed update closes it), so the next windows equal plain PyTorch from a clean start."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"n": 0}

    @accumulate(2, opt, micro_batch_size=2)
    def train_step(x, y):
        calls["n"] += 1
        if calls["n"] == 4:  # the second call's second micro-batch (the first call ran 2 micro-batches)
            raise KeyError("boom")
        loss = F.mse_loss(model(x), y, reduction="sum" if items else "mean")
        return (loss / len(x), len(x)) if items else loss

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    train_step(*data[0])
    with pytest.raises(KeyError, match="boom") as caught:
        train_step(*data[1])
    assert "window (2 call(s)) was dropped" in "".join(caught.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    assert (train_step.pending, train_step.num_updates) == (0, 0)
    train_step(*data[2])
    train_step(*data[3])

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.cat([data[2][0], data[3][0]]), torch.cat([data[2][1], data[3][1]])
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(_params(model), _params(reference), rtol=1e-6, atol=1e-6)


# ------------------------------------------------ a retry after out of memory starts from the state found
class _Counted(torch.nn.Module):
    """Counts its calls in a buffer written in place (any buffer a forward writes), and runs out of memory
    on more rows than ``limit`` allows: after batch norm and dropout have run, as a real forward would."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(64, 64))  # constant: never copied once learnt
        self.limit = 1 << 30

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} rows > {self.limit}")
        return x


def _bn_dropout_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), _Counted(), nn.Linear(8, 1))


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters, the buffers, the global RNG state."""
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())] + [torch.get_rng_state()]


@pytest.mark.parametrize("model_given", [True, False], ids=["model=", "no model="])
@pytest.mark.parametrize("first_oom", [0, 3], ids=["first call", "a later call"])
def test_an_out_of_memory_retry_starts_from_the_buffers_and_random_streams_the_failed_try_found(
    model_given: bool, first_oom: int
) -> None:
    """The failed forward updated BatchNorm's running statistics and ``num_batches_tracked``, a buffer of
    its own and drew dropout masks: the run must be the hand loop's at the size found (2 rows), bitwise."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]

    model = _bn_dropout_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counted = model[3]
    assert isinstance(counted, _Counted)
    torch.manual_seed(7)

    @accumulate(2, opt, micro_batch_size="auto", model=model if model_given else None)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    for i, (x, y) in enumerate(batches):
        if i == first_oom:
            counted.limit = 3  # 8 rows fail, then 4, then 2 rows fit
        train_step(x, y)
    assert train_step.micro_batch_size == 2 and train_step.num_updates == 3

    ref = _bn_dropout_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(7)
    for i, (x, y) in enumerate(batches):  # the hand loop: whole batches, then micro-batches of 2 rows
        size = 8 if i < first_oom else 2
        for lo in range(0, 8, size):
            (F.mse_loss(ref(x[lo : lo + size]), y[lo : lo + size]) * (size / 8) / 2).backward()
        if i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    # the weights to float rounding (the micro-batch weights are applied in another order); the running
    # statistics, the call counter and the RNG stream bitwise
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), rtol=0, atol=1e-6)
    skip = len(list(model.parameters()))
    for a, b in zip(_state(model)[skip:], _state(ref)[skip:], strict=True):
        assert torch.equal(a, b)
    watched = train_step._acc().micro.retry._watched
    assert watched is not None and not any(b is counted.mask for b in watched)  # the constant one is not


def test_an_error_of_the_smaller_size_says_it_came_from_the_retry() -> None:
    """Halved down to 1 row, batch norm cannot train ("Expected more than 1 value per channel"): torch's
    message alone names nothing of the halving; the note does, and the window is as the call found it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @accumulate(2, opt, micro_batch_size="auto")
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if len(x) > 1:
            raise torch.OutOfMemoryError("simulated")
        return F.cross_entropy(out, y)

    with pytest.raises(ValueError, match="more than 1 value per channel") as caught:
        step(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "run again at micro_batch_size=1 after running out of memory" in notes, notes
    assert step.pending == 0 and all(p.grad is None for p in model.parameters())
