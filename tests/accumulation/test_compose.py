"""@accumulate composed with what real loops use: torch.compile, DDP with unused branches, metric schedulers,
fp16 stacked the wrong way, a step calling itself (issue 13, items 1, 3, 6, 7)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from speedups import SpeedupsError, check, ddp_wrap, mixed_precision, shard_model, unshard_model
from speedups.accumulation import accumulate
from speedups.accumulation.grad_sync import DDPSync, grad_sync_for
from tests._dist import WORKERS, free_port, run_torchrun


def _model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# ------------------------------------------------------------------------------- item 1: torch.compile
def test_compiled_ddp_is_recognised_in_either_order_by_accumulate_ddp_wrap_and_check() -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        inner_compiled = torch.nn.parallel.DistributedDataParallel(
            torch.compile(torch.nn.Linear(3, 1), backend="eager")
        )
        for model, expected in ((torch.compile(ddp, backend="eager"), ddp), (inner_compiled, inner_compiled)):
            sync = grad_sync_for(model)
            assert isinstance(sync, DDPSync) and sync.model is expected
            with pytest.raises(TypeError, match="already wrapped"):
                ddp_wrap(model)
            with check(model=model):
                assert len(expected._forward_hooks) == 1  # the no_sync detector sits on the DDP layer
            assert not expected._forward_hooks
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Dynamo does not know:UserWarning")  # a graph break at the hooks
def test_shard_model_sees_through_torch_compile() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    compiled = torch.compile(copy.deepcopy(plain), backend="eager")
    x = torch.randn(3, 4)
    assert shard_model(compiled, {"0": "cpu", "1": "cpu"}) is compiled
    torch.testing.assert_close(compiled(x), plain(x), atol=1e-6, rtol=0)
    assert set(compiled._orig_mod.state_dict()) == set(plain.state_dict())
    assert unshard_model(compiled) is compiled and not hasattr(compiled._orig_mod, "_speedups_sharding")


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_ddp_with_unused_branches_equals_the_plain_reference_on_two_ranks() -> None:
    out = run_torchrun(WORKERS / "accumulate_compose_ddp.py", nproc=2, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    record = r"rank=\d order=\S+ to_ref=\S+ between_ranks=\S+ b_moved=\S+ hook_calls=\d+ updates=\d+"
    lines = re.findall(record, out.stdout)
    assert len(lines) == 6, out.stdout
    for line in lines:
        fields = dict(kv.split("=", 1) for kv in line.split())
        assert float(fields["to_ref"]) < 1e-6, line  # the global big-batch reference (Adam)
        assert float(fields["between_ranks"]) == 0.0, line
        assert float(fields["b_moved"]) == 0.0, line  # unused by every rank: grad None, Adam leaves it
        # 2 epochs x one full window through DDP's all-reduce; every other call inside no_sync
        assert fields["hook_calls"] == "2" and fields["updates"] == "4", line


# ------------------------------------------------------------------------ item 6: metric schedulers
def test_a_scheduler_that_needs_a_metric_is_refused_at_decoration_with_the_fix() -> None:
    _, opt = _model_opt()
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau.*scheduler\.step\(val_loss\)"):
        accumulate(2, opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))

    class NeedsMetric:
        def step(self, metric: float) -> None: ...

    with pytest.raises(TypeError, match="needs an argument"):
        accumulate(2, opt, scheduler=NeedsMetric())
    accumulate(2, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))  # step() alone: accepted


def test_a_failing_scheduler_leaves_the_window_closed_and_counted() -> None:
    model, opt = _model_opt()
    ref = copy.deepcopy(model)

    class Broken:
        def step(self) -> None:
            raise RuntimeError("scheduler broke")

    train_step = accumulate(2, opt, scheduler=Broken())(lambda x, y: F.mse_loss(model(x), y))
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    train_step(x, y)
    with pytest.raises(RuntimeError, match="scheduler broke"):
        train_step(x, y)
    assert train_step.num_updates == 1 and train_step.pending == 0
    assert all(p.grad is None for p in model.parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- item 7: misuse
def test_fp16_stacked_above_accumulate_is_refused_before_anything_changes() -> None:
    model, opt = _model_opt()
    amp = mixed_precision("fp16", device_type="cpu")

    @amp
    @accumulate(2, opt)
    def wrong(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with pytest.raises(SpeedupsError, match=r"fp16 autocast .* entered outside it.*@accumulate\(\.\.\.\)"):
        wrong(torch.randn(4, 3), torch.randn(4, 1))
    assert wrong.step == 0 and wrong.pending == 0 and all(p.grad is None for p in model.parameters())

    @accumulate(2, opt)
    @amp
    def right(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with amp:  # the right order plus an outer `with`: the inner entry hands the scaler over
        right(torch.randn(4, 3), torch.randn(4, 1))
    assert right.scaler is amp.scaler
    other, other_opt = _model_opt()  # its own optimizer: `right`'s window on `opt` is still open
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 needs no scaler: fine around the step
        accumulate(2, other_opt)(lambda x: other(x).float().pow(2).mean())(torch.randn(4, 3))


def test_a_step_that_calls_itself_is_refused_and_its_window_kept() -> None:
    model, opt = _model_opt()
    calls: list[int] = []

    @accumulate(4, opt)
    def train_step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            train_step(x)  # the mistake
        return model(x).pow(2).mean()

    x = torch.randn(4, 3)
    train_step(x)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(SpeedupsError, match="called from inside itself"):
        train_step(x)
    assert train_step.step == 1 and train_step.pending == 1
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
