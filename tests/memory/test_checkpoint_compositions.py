"""checkpoint_activations composed with @accumulate (windows, micro-batches), mixed_precision, torch.compile,
DDP and FSDP2: with dropout drawing, weights and buffers end bit for bit as in the same run without it and as
with ``Blocks(hand=True)`` (``torch.utils.checkpoint`` by hand)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import accumulate, checkpoint_activations, mixed_precision
from speedups.memory.saved_activations import SavedActivations
from tests._dist import FSDP2_REASON, WORKERS, run_torchrun
from tests._models import Blocks

KINDS = ("plain", "ours", "hand")  # no checkpoint, checkpoint_activations, torch.utils.checkpoint by hand


def build(kind: str, depth: int = 3) -> nn.Module:
    model = Blocks(depth=depth, hand=kind == "hand")
    return checkpoint_activations(model, "blocks.*") if kind == "ours" else model


def forwards_of_first_block(model: nn.Module) -> list[int]:
    """A counter (``[n]``) of the forwards of ``blocks.0.fc1``: two per call when its block recomputes."""
    runs = [0]
    model.blocks[0].fc1.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def batches(calls: int, rows: int = 8, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 3, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(calls)]


def state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], *, atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def train(
    net: nn.Module, calls: int, *, every: int = 3, seed: int = 1, **kwargs: Any
) -> tuple[list[torch.Tensor], Any]:
    """``@accumulate(every, AdamW(lr=0.01), **kwargs)`` over ``calls`` calls of 8 rows, then ``flush()``;
    the weights and buffers after it, and the step."""
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    train_step = accumulate(every, opt, **kwargs)(lambda x, y: F.mse_loss(net(x), y))
    torch.manual_seed(seed)  # the dropout masks come from this stream
    for x, y in batches(calls):
        train_step(x, y)
    train_step.flush()
    return state(net), train_step


def test_accumulate_windows_and_a_flushed_short_window_are_bitwise_the_plain_run() -> None:
    got, runs = {}, {}
    for kind in KINDS:
        model = build(kind)
        runs[kind] = forwards_of_first_block(model)
        got[kind], train_step = train(model, 8)  # windows of 3, 3 and a flushed 2
        assert train_step.num_updates == 3
    assert runs == {"plain": [8], "ours": [16], "hand": [16]}  # the recompute really ran
    assert_same(got["ours"], got["plain"])
    assert_same(got["ours"], got["hand"])
    # the hand-written loop: (mean loss / window).backward() per call, one AdamW step per window
    ref = Blocks()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    data = batches(8)
    torch.manual_seed(1)
    for start, stop in [(0, 3), (3, 6), (6, 8)]:
        for x, y in data[start:stop]:
            (F.mse_loss(ref(x), y) / (stop - start)).backward()
        opt.step()
        opt.zero_grad()
    assert_same(got["ours"], state(ref), atol=1e-6)
    # dropout draws: other masks end elsewhere
    other = train(build("ours"), 8, seed=2)[0]
    assert not torch.equal(other[0], got["ours"][0])


def test_micro_batches_of_3_3_2_rows_are_bitwise_the_plain_micro_batched_run() -> None:
    got, rows, runs = {}, {}, {}
    for kind in KINDS:
        model = build(kind)
        runs[kind] = forwards_of_first_block(model)
        seen: list[int] = []
        model.inp.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(len(args[0])))
        got[kind], train_step = train(model, 5, every=2, micro_batch_size=3)
        rows[kind] = seen
        assert train_step.num_updates == 3  # windows of 2, 2 and a flushed 1
    assert rows["ours"] == rows["plain"] == [3, 3, 2] * 5  # each call of 8 rows in 3 forwards
    assert runs == {"plain": [15], "ours": [30], "hand": [30]}
    assert_same(got["ours"], got["plain"])
    assert_same(got["ours"], got["hand"])
    # by hand: each call's mean loss is the row-weighted sum of its pieces' means; another summation order
    ref = Blocks()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    data = batches(5)
    torch.manual_seed(1)
    for start, stop in [(0, 2), (2, 4), (4, 5)]:
        for x, y in data[start:stop]:
            for xs, ys in zip(x.split(3), y.split(3), strict=True):
                (F.mse_loss(ref(xs), ys) * len(xs) / len(x) / (stop - start)).backward()
        opt.step()
        opt.zero_grad()
    assert_same(got["ours"], state(ref), atol=1e-6)


@pytest.mark.parametrize("spelling", ["stacked", "with"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_bf16_and_fp16_with_its_scaler_are_bitwise_the_plain_run(
    dtype: str, spelling: str
) -> None:
    """CPU autocast in both dtypes (fp16 with the step's GradScaler), stacked under @accumulate or as a
    ``with`` in the step's body."""
    got, runs = {}, {}
    for kind in KINDS:
        model = build(kind)
        runs[kind] = forwards_of_first_block(model)
        out_dtypes: list[torch.dtype] = []
        model.out.register_forward_hook(lambda *a, seen=out_dtypes: seen.append(a[-1].dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        stepped: list[int] = []
        opt.register_step_post_hook(lambda *_, stepped=stepped: stepped.append(1))
        amp = mixed_precision(dtype, device_type="cpu", init_scale=2.0**8)

        def loss(x: torch.Tensor, y: torch.Tensor, model: nn.Module = model, amp=amp) -> torch.Tensor:
            if spelling == "stacked":
                return F.mse_loss(model(x), y)
            with amp:
                return F.mse_loss(model(x), y)

        train_step = accumulate(3, opt)(amp(loss) if spelling == "stacked" else loss)
        torch.manual_seed(1)
        for x, y in batches(8):
            train_step(x, y)
        train_step.flush()
        got[kind] = state(model)
        assert set(out_dtypes) == {torch.bfloat16 if dtype == "bf16" else torch.float16}
        assert (train_step.scaler is not None) == (dtype == "fp16")
        assert len(stepped) == 3  # no fp16 step skipped: the weights moved each window
    assert runs == {"plain": [8], "ours": [16], "hand": [16]}
    assert_same(got["ours"], got["plain"])
    assert_same(got["ours"], got["hand"])
    assert not torch.equal(got["ours"][0], Blocks().inp.weight)


# ----------------------------------------------------------------------------------------- torch.compile
def compiled(kind: str, backend: str) -> tuple[nn.Module, nn.Module]:
    """(plain module, ``torch.compile(model, backend)``), checkpointed before or after compiling."""
    model = Blocks(depth=2)
    if kind == "before":
        checkpoint_activations(model, "blocks.*")
    wrapped = torch.compile(model, backend=backend)
    if kind == "after":
        assert checkpoint_activations(wrapped, "blocks.*") is wrapped  # names of the plain model
    return model, wrapped


def train_compiled(kind: str, backend: str) -> tuple[list[torch.Tensor], SavedActivations]:
    """4 calls of @accumulate(2) through the compiled model, then one forward+backward counted."""
    _, wrapped = compiled(kind, backend)
    got, _ = train(wrapped, 4, every=2, model=wrapped)
    x = torch.randn(8, 3)  # the training shape: no recompile
    with SavedActivations(wrapped) as saved:
        loss = wrapped(x).sum()
        forward_bytes = dict(saved.bytes_by_block)
        loss.backward()
    assert saved.bytes_by_block == forward_bytes  # all of it saved by the forward
    return got, saved


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
def test_compiled_aot_eager_trains_bitwise_and_keeps_only_block_inputs(order: str) -> None:
    """aot_eager: dropout draws as in eager (inductor's RNG differs), so the check is bitwise."""
    torch.compiler.reset()
    ours, less = train_compiled(order, "aot_eager")  # first: it is the one that fails
    plain, saved = train_compiled("plain", "aot_eager")
    assert_same(ours, plain)
    for name in ("blocks.0", "blocks.1"):
        assert less.bytes_by_block[name] == 8 * 16 * 4 < saved.bytes_by_block[name]  # its input only
    assert less.total_bytes < 0.3 * saved.total_bytes


@pytest.mark.slow
def test_compiled_inductor_checkpointed_blocks_run_eagerly_as_their_recompute(monkeypatch) -> None:
    """A checkpointed block runs eagerly under compile (as torch runs its recompute): its dropout draws the
    eager masks, so the run is the eager plain run's, to inductor's rounding of the compiled rest."""
    # inductor writes this into os.environ each time it loads a kernel: gone again after the test
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "0")
    monkeypatch.delenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
    torch.compiler.reset()
    ours, less = train_compiled("after", "inductor")
    eager, _ = train(Blocks(depth=2), 4, every=2)
    assert_same(ours, eager, atol=1e-5)
    assert less.bytes_by_block["blocks.0"] == 8 * 16 * 4  # its input only


# ----------------------------------------------------------------------------------- DDP and FSDP2 (2 ranks)
@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One torchrun job for every DDP and FSDP2 configuration (tests/workers/checkpoint_parallel.py)."""
    out = tmp_path_factory.mktemp("checkpoint_parallel")
    job = run_torchrun(WORKERS / "checkpoint_parallel.py", [str(out)], nproc=2, timeout=240)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


def assert_configs_equal(results: list[dict], name: str, base: str) -> None:
    """Bitwise equal to ``base`` on each rank, the same on both ranks; recomputed unless ``name`` is plain."""
    for rank in (0, 1):
        assert results[rank][name]["runs"] == (10 if name.endswith("plain") else 20), (rank, name)
        for part in ("params", "buffers"):
            assert_same(results[rank][name][part], results[rank][base][part])
        assert results[rank]["losses"][name] == results[rank]["losses"][base], (rank, name)
    assert_same(results[0][name]["params"], results[1][name]["params"])  # the replicas agree


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_with_no_sync_windows_is_bitwise_the_plain_ddp_run_on_each_rank(parallel_results) -> None:
    """ddp_wrap + @accumulate(3, model=ddp): checkpointed before or after wrapping, or by hand."""
    results = parallel_results
    for kind in ("plain", "before", "after", "hand"):
        assert_configs_equal(results, f"ddp_{kind}", "ddp_plain")
    for kind in ("plain", "after"):
        assert_configs_equal(results, f"ddp_batch_{kind}", "ddp_batch_plain")  # BatchNorm's buffers too
    assert len(results[0]["ddp_batch_after"]["buffers"]) == 6
    for rank in (0, 1):
        for name in ("ddp_plain", "ddp_before", "ddp_after", "ddp_hand", "ddp_batch_after"):
            # 2 epochs x (a window of 3 + a flushed 2): DDP's own all-reduce in the full windows only
            assert results[rank][name]["all_reduces"] == 2, (rank, name)
    assert results[0]["losses"]["ddp_plain"] != results[1]["losses"]["ddp_plain"]  # ranks' own data
    assert not torch.equal(results[0]["ddp_plain"]["params"][0], Blocks(depth=2).inp.weight)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_checkpointed_before_or_after_sharding_is_bitwise_the_plain_fsdp2_run(parallel_results) -> None:
    """ddp_wrap(strategy="fsdp") on the root, and with each block sharded on its own first."""
    results = parallel_results
    if "fsdp_plain" not in results[0]:
        pytest.skip(FSDP2_REASON)
    for kind in ("plain", "before", "after", "hand"):
        assert_configs_equal(results, f"fsdp_{kind}", "fsdp_plain")
    for kind in ("plain", "before", "after"):
        assert_configs_equal(results, f"fsdp_blocks_{kind}", "fsdp_blocks_plain")
    assert results[0]["losses"]["fsdp_plain"] != results[1]["losses"]["fsdp_plain"]
    # FSDP2 trains as DDP does (2 ranks: the same sums, but another collective)
    assert_same(results[0]["fsdp_plain"]["params"], results[0]["ddp_plain"]["params"], atol=1e-6)
