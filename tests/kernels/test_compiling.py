"""compile_blocks: torch.compile on the named blocks, in place and undone; against the eager model, here.

backend="eager" (dynamo traces, nothing is lowered) must be bitwise eager; inductor within a stated tolerance.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedups import (
    SpeedupsError,
    accumulate,
    checkpoint_activations,
    compile_blocks,
    mixed_precision,
    uncheckpoint_activations,
    uncompile_blocks,
)
from speedups._helpers import compat
from speedups.kernels.compiling import compiled_blocks
from speedups.memory.activation_checkpointing import checkpointed as checkpointed_blocks
from tests._models import Blocks

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _data(calls: int = 6, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 3, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(calls)]


def _train(model: nn.Module, every: int = 3, micro_batch_size: int | None = None, amp: bool = False):
    """Weights and losses after ``@accumulate(every)`` over 6 calls (dropout from one seed)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def loss_of(x, y):
        return F.mse_loss(model(x), y)

    if amp:
        loss_of = mixed_precision("bf16")(loss_of)
    step = accumulate(every, opt, micro_batch_size=micro_batch_size)(loss_of)
    torch.manual_seed(1000)
    losses = [step(x, y).item() for x, y in _data()]
    return [p.detach().clone() for p in model.parameters()], losses


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_blocks_compiled_with_the_eager_backend_train_bitwise_as_the_plain_model_and_undo() -> None:
    """dynamo traces each block's call (hooks included), dropout draws the same masks: bitwise, @accumulate
    with and without micro-batching; state_dict keys unchanged; uncompile_blocks leaves no compiled call."""
    for micro in (None, 4):
        want = _train(Blocks(depth=3), micro_batch_size=micro)
        model = Blocks(depth=3)
        keys = list(model.state_dict())
        assert compile_blocks(model, "blocks.*", backend="eager") is model
        assert compiled_blocks(model) == ["blocks.0", "blocks.1", "blocks.2"]
        assert all(b.__dict__.get("_compiled_call_impl") is not None for b in model.blocks)
        got = _train(model, micro_batch_size=micro)
        _same(got[0], want[0])
        assert got[1] == want[1]
        assert list(model.state_dict()) == keys  # checkpoints load into the plain model and back
        plain = Blocks(depth=3)
        plain.load_state_dict(model.state_dict())
        _same(list(plain.parameters()), list(model.parameters()))
        uncompile_blocks(model)
        assert compiled_blocks(model) == []
        assert all("_compiled_call_impl" not in b.__dict__ for b in model.modules())


def test_blocks_compiled_with_inductor_follow_eager_within_float_rounding() -> None:
    """Inductor fuses and reorders float sums: within 1e-5 after 2 optimizer steps (AdamW, lr 0.01); its
    own RNG would draw other dropout masks, so torch's (fallback_random) is used for the comparison."""
    want = _train(Blocks(depth=2))
    model = compile_blocks(Blocks(depth=2), "blocks.*", options={"fallback_random": True})
    got = _train(model)
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6)


def test_compiled_blocks_compose_with_checkpointing_and_mixed_precision() -> None:
    """Blocks both checkpointed and compiled, or some of each, under bf16 autocast: bitwise (eager
    backend)."""
    want = _train(checkpoint_activations(Blocks(depth=3), "blocks.*"), amp=True)
    for compiled, checkpointed in (("blocks.*", "blocks.*"), (["blocks.0", "blocks.2"], "blocks.1")):
        model = checkpoint_activations(Blocks(depth=3), checkpointed)
        compile_blocks(model, compiled, backend="eager")
        got = _train(model, amp=True)
        _same(got[0], want[0])
        assert got[1] == want[1]
        if compiled == "blocks.*":
            plain = _train(Blocks(depth=3), amp=True)
            _same(got[0], plain[0])  # checkpointing changes no value either


def _both_orders(backend_options: dict) -> list[tuple[str, nn.Module]]:
    """Blocks with dropout and BatchNorm, compiled and checkpointed on the same blocks, in both orders."""
    first = compile_blocks(Blocks(depth=2, norm="batch"), "blocks.*", **backend_options)
    second = checkpoint_activations(Blocks(depth=2, norm="batch"), "blocks.*")
    return [
        ("compile_blocks first", checkpoint_activations(first, "blocks.*")),
        ("checkpoint_activations first", compile_blocks(second, "blocks.*", **backend_options)),
    ]


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def test_blocks_compiled_through_aot_autograd_and_checkpointed_train_as_the_plain_model_in_either_order() -> (
    None
):
    """A compiled block's recompute runs its compiled code (torch's checkpoint turns dynamo off around it, the
    block's own compiled call turns it back on), so its forward must too: AOT autograd saves other tensors
    than eager autograd, and the count or metadata check raised CheckpointError at the first backward.
    aot_eager runs AOT autograd's graphs with eager kernels: dropout masks and BatchNorm buffers as the plain
    model's, within 1e-6 (seen: equal)."""
    plain = Blocks(depth=2, norm="batch")
    want = _train(plain)
    for order, model in _both_orders({"backend": "aot_eager"}):
        got = _train(model)
        for a, b in zip(_state(model), _state(plain), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=order)
        assert got[1] == pytest.approx(want[1], rel=1e-6, abs=1e-7), order
        torch.compiler.reset()


@pytest.mark.slow
def test_blocks_compiled_with_inductor_and_checkpointed_train_as_the_plain_model_in_either_order() -> None:
    """The field case: inductor (the default backend) with checkpoint_activations on the same blocks. With
    torch's RNG (fallback_random), within 1e-5 of the plain model after 2 AdamW steps (seen: 9e-8); with
    inductor's own RNG, the recompute draws the forward's dropout masks: bitwise the compiled run without
    checkpointing."""
    plain = Blocks(depth=2, norm="batch")
    want = _train(plain)
    for order, model in _both_orders({"options": {"fallback_random": True}}):
        got = _train(model)
        for a, b in zip(_state(model), _state(plain), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=order)
        assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6), order
        torch.compiler.reset()
    compiled = compile_blocks(Blocks(depth=2, norm="batch"), "blocks.*")
    _train(compiled)
    torch.compiler.reset()
    both = checkpoint_activations(compile_blocks(Blocks(depth=2, norm="batch"), "blocks.*"), "blocks.*")
    _train(both)
    _same(_state(both), _state(compiled))


def test_names_are_the_plain_models_through_wrappers_and_either_order_with_compile() -> None:
    model = Blocks(depth=2)
    whole = torch.compile(model, backend="eager")
    assert compile_blocks(whole, "blocks.1", backend="eager") is whole
    assert compiled_blocks(model) == ["blocks.1"] and compiled_blocks(whole) == ["blocks.1"]
    x = torch.randn(4, 3)
    model.eval()
    torch.testing.assert_close(whole(x), Blocks(depth=2).eval()(x), rtol=0, atol=0)
    uncompile_blocks(whole, "blocks.*")
    assert compiled_blocks(model) == []


def test_bad_input_is_refused_before_any_block_is_compiled() -> None:
    model = Blocks(depth=2)
    with pytest.raises(TypeError, match=r"compile_blocks\(.*\): model must be an nn.Module, got str"):
        compile_blocks("model", "blocks.*")  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"compile_blocks\(Blocks, 'blocks.\*'\): modee= is not an option of "
                       r"torch.compile; it takes .*mode"):  # fmt: skip
        compile_blocks(model, "blocks.*", modee="max-autotune")
    with pytest.raises(
        ValueError,
        match=r"'block.\*' matches no submodule of Blocks. Its blocks are 'inp', 'blocks.0'.* Did you mean "
        r"'blocks.\*'",  # first, the pattern the typo was for, not a single block
    ):
        compile_blocks(model, "block.*")
    with pytest.raises(ValueError, match=r"picks 'blocks', a ModuleList, .* nothing would be compiled"):
        compile_blocks(model, "blocks")
    with pytest.raises(TypeError, match=r"compile_blocks\(model, 'blocks.\*'\) or \(model, \[Block\]\)"):
        compile_blocks(model, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"enabled must be True or False"):
        compile_blocks(model, "blocks.*", enabled="yes")  # type: ignore[arg-type]
    assert compiled_blocks(model) == [] and not any(
        "_compiled_call_impl" in m.__dict__ for m in model.modules()
    )
    assert compile_blocks(model, "blocks.*", enabled=False) is model and compiled_blocks(model) == []
    compile_blocks(model, "blocks.0", backend="eager")
    with pytest.raises(
        SpeedupsError, match=r"'blocks.0' is already compiled by compile_blocks\. Call uncompile"
    ):
        compile_blocks(model, "blocks.*", backend="eager")
    assert compiled_blocks(model) == ["blocks.0"]  # blocks.1 was not compiled before the refusal
    model.out.compile(backend="eager")  # by hand
    with pytest.raises(SpeedupsError, match=r"'out' is already compiled by its own compile\(\)"):
        compile_blocks(model, "out")
    with pytest.raises(SpeedupsError, match=r"'' lies inside or around 'out', which is compiled by its own"):
        compile_blocks(model, "")  # the whole model, around a compiled block


def _eager_outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x)


def test_each_refusal_of_a_compiled_block_names_a_fix_that_works_when_applied() -> None:
    """The trial: model[0].compile() by hand, then compile_blocks(model, '*') was refused with 'Call
    uncompile_blocks(model) first', and uncompile_blocks was a no-op (it undoes only what compile_blocks
    did): the same refusal again. Each message's code is run here as written: uncompile_blocks for a block
    compile_blocks compiled; for one compiled by hand (itself, inside or around a block picked, or the whole
    model), the call without the blocks it clashes with, or the call on a model without that compile()
    call. Each then runs bitwise as the eager model (eager backend), the hand-compiled block still compiled
    (uncompile_blocks leaves it alone: speedups did not compile it)."""
    x = torch.randn(4, 3)
    want = _eager_outputs(Blocks(depth=2), x)

    def fixes(message: str) -> list[str]:
        return re.findall(r"(?:Call |: )((?:un)?compile_blocks\(model[^;]*?\))(?: first|[.;])", message)

    def run_fix(code: str, model: nn.Module) -> None:
        eval(code, {"compile_blocks": compile_blocks, "uncompile_blocks": uncompile_blocks, "model": model})

    ours = Blocks(depth=2)
    compile_blocks(ours, "blocks.0", backend="eager")
    with pytest.raises(SpeedupsError) as refused:
        compile_blocks(ours, "blocks.*", backend="eager")
    assert fixes(str(refused.value)) == ["uncompile_blocks(model)"]
    run_fix("uncompile_blocks(model)", ours)
    compile_blocks(ours, "blocks.*", backend="eager")  # "then compile the blocks you want in one call"
    assert compiled_blocks(ours) == ["blocks.0", "blocks.1"]
    assert torch.equal(_eager_outputs(ours, x), want)

    by_hand = {  # case: (the module compiled by hand, the names asked, the fix leaving it out)
        "the block itself": ("blocks.0", "blocks.*", "compile_blocks(model, 'blocks.1', backend='eager')"),
        "inside a block": ("blocks.0.fc1", ["blocks.*", "out"],
                           "compile_blocks(model, ['blocks.1', 'out'], backend='eager')"),
        "around the blocks": ("", "blocks.*", None),
    }  # fmt: skip
    for case, (hand, names, leave_out) in by_hand.items():
        model = Blocks(depth=2)
        model.get_submodule(hand).compile(backend="eager")
        with pytest.raises(SpeedupsError) as refused:
            compile_blocks(model, names, backend="eager")
        message = str(refused.value)
        assert "uncompile_blocks(model) first" not in message, case
        uncompile_blocks(model)  # what the old message said: a no-op here, and still refused
        assert compat.has_compiled_call(model.get_submodule(hand)), case
        with pytest.raises(SpeedupsError):
            compile_blocks(model, names, backend="eager")
        again = f"compile_blocks(model, {names!r}, backend='eager')"
        assert fixes(message) == ([leave_out] if leave_out else []) + [again], (case, message)
        if leave_out is not None:
            run_fix(leave_out, model)
            assert compat.has_compiled_call(model.get_submodule(hand)), case
            assert torch.equal(_eager_outputs(model, x), want), case
        fresh = Blocks(depth=2)  # the other fix: that compile() call left out
        run_fix(again, fresh)
        assert compiled_blocks(fresh) == ["blocks.0", "blocks.1"] + (["out"] if "out" in names else [])
        assert torch.equal(_eager_outputs(fresh, x), want), case
        torch.compiler.reset()


def test_a_checkpoint_refusal_names_a_fix_that_works_when_applied() -> None:
    """checkpoint_activations' one refusal of state (a block inside or around a checkpointed one) says
    'Call uncheckpoint_activations(model) first': run as written (on the compiled wrapper, as the user holds
    it), the call then goes through."""
    model = Blocks(depth=2)
    whole = torch.compile(model, backend="eager")
    checkpoint_activations(whole, "blocks.*")
    with pytest.raises(SpeedupsError, match=r"Call uncheckpoint_activations\(model\) first, then checkpoint"):
        checkpoint_activations(whole, "blocks.0.*")
    uncheckpoint_activations(whole)
    checkpoint_activations(whole, "blocks.0.*")
    assert checkpointed_blocks(whole) == ["blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2", "blocks.0.drop"]


def test_a_deep_copy_of_a_model_with_compiled_blocks_runs_eagerly_and_says_so() -> None:
    model = compile_blocks(Blocks(depth=2), "blocks.*", backend="eager")
    twin = copy.deepcopy(model)  # nn.Module drops its compiled call when copied or pickled
    assert all("_compiled_call_impl" not in b.__dict__ for b in twin.blocks)
    assert compiled_blocks(twin) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_blocks_under_ddp_and_fsdp2_in_either_order_train_bitwise_as_without(tmp_path) -> None:
    """2 gloo ranks, @accumulate(3, model=...) with a flushed short window; compiled before or after
    wrapping (FSDP2: the whole model, or each block sharded on its own): bitwise the uncompiled run."""
    from tests._dist import WORKERS, run_torchrun

    job = run_torchrun(WORKERS / "compile_parallel.py", [str(tmp_path)], nproc=2, timeout=300)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, got in results.items():
            base = results[name.rsplit("_", 1)[0] + "_plain"]
            assert got["compiled"] == ([] if name.endswith("plain") else ["blocks.0", "blocks.1"]), name
            _same(got["params"], base["params"])
            assert got["losses"] == base["losses"], name
