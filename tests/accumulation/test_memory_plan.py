"""@accumulate(..., memory_budget=...): the plan of micro-batch size and checkpointed blocks, measured on the
first calls, fits the budget (counted activations on the CPU), is the fastest it tried, keeps the big batch's
gradients, resumes without new trials, and refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, accumulate, checkpoint_activations
from speedups.accumulation.micro_batching import PlanChoice
from speedups.memory import checkpointed
from speedups.memory.saved_activations import SavedActivations
from tests._models import Blocks, FakeFSDP2

ROWS = 16


def batches(n: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 1, generator=g)) for _ in range(n)]


def model_bytes(model: nn.Module, rows: int = ROWS) -> int:
    """The activations a plain forward and backward of ``rows`` rows keep at peak (counted)."""
    with SavedActivations(model) as counted:
        model(torch.randn(rows, 3)).sum().backward()
    model.zero_grad(set_to_none=True)
    return counted.peak_bytes


def tight_budget() -> int:
    """Below what one row keeps without checkpointing: every plan that fits checkpoints some block, whatever
    the timings (under half the whole batch's bytes, a plan of micro-batches alone may win on a noisy CPU)."""
    return model_bytes(Blocks(depth=4, width=32), rows=1) * 2 // 3


def plan_of(step: object) -> object:
    return step._acc().micro.plan  # type: ignore[attr-defined]


def test_the_plan_fits_the_budget_is_the_fastest_tried_and_keeps_the_big_batch() -> None:
    model, ref = Blocks(depth=4, width=32, seed=1), Blocks(depth=4, width=32, seed=1)
    ref.eval(), model.eval()  # no dropout: the plan's calls run at other sizes than the reference
    budget = model_bytes(model) // 2
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)

    @accumulate(2, opt, memory_budget=budget, model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    data = batches(16)
    for x, y in data:
        step(x, y)
    for i in range(0, len(data), 2):  # the big batch by hand: the window's mean loss
        for x, y in data[i : i + 2]:
            (nn.functional.mse_loss(ref(x), y) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    choice = step.memory_plan
    plan = plan_of(step)
    assert isinstance(choice, PlanChoice) and plan.tried  # type: ignore[attr-defined]
    fitting = [c for c in plan.tried if c.seconds_per_row is not None]  # type: ignore[attr-defined]
    assert choice == min(fitting, key=lambda c: c.seconds_per_row)
    assert step.micro_batch_size == choice.micro_batch_size
    assert checkpointed(model) == sorted(choice.checkpointed, key=lambda n: int(n.split(".")[1]))
    # what it keeps now, counted on a fresh call, is within the budget; the plain run's is not
    with SavedActivations(model) as counted:
        step(*data[0])
    assert counted.peak_bytes <= budget < 2 * budget <= model_bytes(Blocks(depth=4, width=32))
    assert choice.bytes is not None and choice.bytes <= budget


def test_a_budget_the_whole_batch_fits_decides_after_one_call_with_nothing_checkpointed() -> None:
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @accumulate(1, opt, memory_budget=10 * model_bytes(model), model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    assert step.memory_plan is None
    step(*batches(1)[0])
    assert step.memory_plan == PlanChoice(ROWS, (), None, None)
    assert plan_of(step).tried == []  # type: ignore[attr-defined]
    assert checkpointed(model) == []


def test_a_fixed_micro_batch_size_plans_the_checkpointing_only() -> None:
    model = Blocks(depth=4, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = model_bytes(model, rows=4) // 2

    @accumulate(1, opt, micro_batch_size=4, memory_budget=budget, model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    for x, y in batches(12):
        step(x, y)
    choice = step.memory_plan
    assert choice is not None and choice.micro_batch_size == 4 and choice.checkpointed
    assert all(c.micro_batch_size == 4 for c in plan_of(step).tried)  # type: ignore[attr-defined]


def test_a_user_checkpointed_block_is_left_as_it_is() -> None:
    model = Blocks(depth=4, width=32)
    checkpoint_activations(model, "blocks.0")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @accumulate(1, opt, memory_budget=model_bytes(model) // 2, model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    for x, y in batches(14):
        step(x, y)
    assert step.memory_plan is not None and "blocks.0" not in step.memory_plan.checkpointed
    assert "blocks.0" in checkpointed(model)


def test_a_budget_nothing_fits_raises_before_the_next_call_changes_anything() -> None:
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @accumulate(2, opt, memory_budget=64, model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    (x, y), (x2, y2) = batches(2)
    step(x, y)  # the probe runs and counts
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(SpeedupsError, match=r"memory_budget=64\): nothing fits in 64 bytes: 1 row\(s\)"):
        step(x2, y2)
    assert step.step == 1 and step.pending == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))  # type: ignore[arg-type]


def test_a_resumed_step_takes_the_saved_plan_without_new_trials() -> None:
    def build() -> tuple[nn.Module, object]:
        model = Blocks(depth=4, width=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @accumulate(1, opt, memory_budget=tight_budget(), model=model)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(model(x), y)

        return model, step

    _, step = build()
    for x, y in batches(14):
        step(x, y)  # type: ignore[operator]
    state = step.state_dict()  # type: ignore[attr-defined]
    assert state["plan"]["checkpointed"]
    assert state["plan"] == {
        "micro_batch_size": step.memory_plan.micro_batch_size,  # type: ignore[attr-defined]
        "checkpointed": list(step.memory_plan.checkpointed),  # type: ignore[attr-defined]
        "budget": plan_of(step).budget_spec,  # type: ignore[attr-defined]
    }
    model2, step2 = build()
    step2.load_state_dict(state)  # type: ignore[attr-defined]
    assert step2.memory_plan == PlanChoice(
        state["plan"]["micro_batch_size"], tuple(state["plan"]["checkpointed"])
    )  # type: ignore[attr-defined]
    assert sorted(checkpointed(model2)) == sorted(state["plan"]["checkpointed"])
    assert step2.micro_batch_size == state["plan"]["micro_batch_size"]  # type: ignore[attr-defined]
    step2(*batches(1)[0])  # type: ignore[operator]
    assert plan_of(step2).tried == []  # type: ignore[attr-defined]
    bad = dict(state, plan={"micro_batch_size": 4, "checkpointed": ["nope.*"]})
    with pytest.raises(ValueError, match=r"saved memory plan.*'nope\.\*' matches no submodule"):
        step2.load_state_dict(bad)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(memory_budget="lots"), ValueError, "the only string allowed is 'auto'"),
        (dict(memory_budget=0), ValueError, r"must be >= 1 \(bytes\)"),
        (dict(memory_budget=1.5e9), TypeError, "expected an int of bytes >= 1 or 'auto', got float"),
        (dict(memory_budget=True), TypeError, "got bool"),
        (dict(memory_budget=2**30, model=None), ValueError, "it needs model="),
        (dict(memory_budget=2**30, model="m"), TypeError, "model"),
    ],
)
def test_bad_budgets_are_refused_when_decorating(kwargs: dict, error: type, match: str) -> None:
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"model": model, **kwargs}
    with pytest.raises(error, match=match):
        accumulate(1, opt, **kwargs)


def test_fsdp2_is_refused_with_the_fix() -> None:
    model = FakeFSDP2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SpeedupsError, match=r"FSDP2.*micro_batch_size=<int>.*checkpoint_activations"):
        accumulate(1, opt, memory_budget=2**30, model=model)(lambda x: x)


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_of_a_ddp_job_agree_on_the_plan_and_stay_in_step(tmp_path) -> None:
    from tests._dist import WORKERS, run_torchrun

    job = run_torchrun(WORKERS / "memory_plan_ddp.py", [str(tmp_path)], nproc=2, timeout=240)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    chosen = [(r["choice"].micro_batch_size, r["choice"].checkpointed) for r in (r0, r1)]
    assert chosen[0] == chosen[1]  # one plan (each rank keeps its own timing of it)
    assert (
        r0["checkpointed"] == r1["checkpointed"] and r0["size"] == r1["size"] == r0["choice"].micro_batch_size
    )
    assert [(c.micro_batch_size, c.checkpointed) for c in r0["tried"]] == [
        (c.micro_batch_size, c.checkpointed) for c in r1["tried"]
    ]
    assert r0["choice"].bytes <= r0["budget"]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the replicas agree


@pytest.mark.cuda
def test_on_a_gpu_the_plan_measures_the_peak_and_fits_it() -> None:
    torch.manual_seed(0)
    model = Blocks(depth=6, width=256).cuda().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4096, 3, device="cuda"), torch.randn(4096, 1, device="cuda")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    nn.functional.mse_loss(model(x), y).backward()
    plain_peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    budget = plain_peak // 2

    @accumulate(1, opt, memory_budget=budget, model=model)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    for _ in range(20):
        step(x, y)
    choice = step.memory_plan
    assert choice is not None and choice.bytes is not None and choice.bytes <= budget
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(x, y)
    assert torch.cuda.max_memory_allocated() - base <= budget


def test_a_state_saved_under_another_budget_plans_anew() -> None:
    def make(budget: int) -> tuple[nn.Module, object]:
        model = Blocks(depth=4, width=32)  # a fresh process's model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = accumulate(1, opt, memory_budget=budget, model=model)(
            lambda x, y: nn.functional.mse_loss(model(x), y)
        )
        return model, step

    budget = tight_budget()
    _, step = make(budget)
    for x, y in batches(14):
        step(x, y)  # type: ignore[operator]
    state = step.state_dict()  # type: ignore[attr-defined]
    assert state["plan"]["budget"] == budget and state["plan"]["checkpointed"]
    model, roomy = make(100 * budget)
    roomy.load_state_dict(state)  # type: ignore[attr-defined]
    assert roomy.memory_plan is None and checkpointed(model) == []  # type: ignore[attr-defined]
    roomy(*batches(1)[0])  # type: ignore[operator]
    assert roomy.memory_plan == PlanChoice(ROWS, (), None, None)  # type: ignore[attr-defined]
