"""checkpoint_activations: bit for bit the plain run (dropout, BatchNorm) and torch.utils.checkpoint by hand;
names, patterns and classes; refusals before anything is registered; the undo; the bytes it saves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, checkpoint_activations, uncheckpoint_activations
from speedups.memory import checkpointed, model_blocks
from speedups.memory.saved_activations import OUTSIDE, SavedActivations
from tests._models import Blocks, DropBlock


def train(
    model: nn.Module, steps: int = 4, *, opt_cls: type = torch.optim.AdamW, seed: int = 1
) -> list[torch.Tensor]:
    """A plain loop: the weights and buffers after ``steps`` optimizer steps on fixed random data."""
    opt = opt_cls(model.parameters(), lr=0.01)
    torch.manual_seed(seed)  # the dropout masks come from this stream
    for _ in range(steps):
        x, y = torch.randn(8, 3), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_bitwise_equal_to_plain_and_to_hand_written_checkpoint_with_dropout() -> None:
    plain = train(Blocks())
    hand = train(Blocks(hand=True))
    ours = Blocks()
    assert checkpoint_activations(ours, "blocks.*") is ours
    assert checkpointed(ours) == ["blocks.0", "blocks.1", "blocks.2"]
    got = train(ours)
    assert_same(plain, hand)
    assert_same(plain, got)
    # dropout really draws: the same run with other masks ends elsewhere
    other = train(Blocks(), seed=2)
    assert not torch.equal(other[0], plain[0])


def test_batchnorm_running_statistics_end_as_in_the_plain_run() -> None:
    plain = train(Blocks(norm="batch"))
    ours = checkpoint_activations(Blocks(norm="batch"), "blocks.*")
    assert_same(plain, train(ours))
    # torch.utils.checkpoint by hand updates them twice per step: what the hooks put right
    hand = train(Blocks(norm="batch", hand=True))
    assert not torch.equal(hand[-3], plain[-3])


class CountingBlock(nn.Module):
    """A forward that writes a buffer in place (a running count) and a Python attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.python_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        self.python_calls += 1
        return torch.tanh(self.fc(x))


def test_buffers_a_forward_writes_are_put_back_after_the_recompute() -> None:
    model = nn.Sequential(CountingBlock(), nn.Linear(4, 1))
    checkpoint_activations(model, "0")
    for _ in range(3):
        model(torch.ones(5, 4)).sum().backward()
    assert model[0].seen.item() == 15  # a plain run's count; without the restore: 30
    assert model[0].python_calls == 6  # Python side effects do run again (documented)


def test_patterns_pick_whole_blocks_classes_and_lists() -> None:
    model = Blocks(depth=3)
    assert [n for n, _ in model_blocks(model)] == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
    checkpoint_activations(model, DropBlock)
    assert checkpointed(model) == ["blocks.0", "blocks.1", "blocks.2"]  # not blocks.0.fc1
    uncheckpoint_activations(model)
    checkpoint_activations(model, ["blocks.[02]", "out"])
    assert checkpointed(model) == ["blocks.0", "blocks.2", "out"]
    uncheckpoint_activations(model)
    checkpoint_activations(model, ["blocks.1", "blocks.1.fc1"])  # the outermost only
    assert checkpointed(model) == ["blocks.1"]
    # a second call adds blocks beside those already checkpointed, and repeats are kept as they are
    uncheckpoint_activations(model)
    checkpoint_activations(model, "blocks.0")
    checkpoint_activations(model, ["blocks.0", "blocks.1"])
    assert checkpointed(model) == ["blocks.0", "blocks.1"]


def test_a_sequential_is_one_block_inside_a_model_and_opened_as_the_model() -> None:
    torch.manual_seed(0)
    inner = nn.ModuleList(nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2))
    model = nn.Sequential(nn.Linear(3, 4), nn.ModuleDict({"h": inner}), nn.Linear(4, 1))
    assert [n for n, _ in model_blocks(model)] == ["0", "1.h.0", "1.h.1", "2"]
    checkpoint_activations(model, "1.h.*")
    assert checkpointed(model) == ["1.h.0", "1.h.1"]


def test_names_are_the_plain_models_inside_compile_and_dataparallel_wrappers() -> None:
    model = Blocks()
    wrapped = nn.DataParallel(model)  # CPU: a plain call; its names carry "module."
    assert checkpoint_activations(wrapped, "blocks.*") is wrapped
    assert checkpointed(model) == ["blocks.0", "blocks.1", "blocks.2"]
    uncheckpoint_activations(wrapped)
    assert checkpointed(model) == []


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        (
            "block.*",
            ValueError,
            r"'block\.\*' matches no submodule of Blocks\. Its blocks are 'inp', 'blocks\.0'",
        ),
        ("blocks.*.*.*", ValueError, "matches no submodule"),
        (nn.Conv2d, ValueError, "Its blocks are of the classes"),
        ([], ValueError, "names is empty"),
        (3, TypeError, "names must be a submodule name or pattern"),
        ([int], TypeError, "int is not an nn.Module class"),
        ({"blocks.0": 1}, TypeError, "names must be"),
        # a ModuleList is never called: its hooks would never fire, and nothing would be checkpointed
        ("blocks", ValueError, r"picks 'blocks', a ModuleList, which is never called.*'blocks\.\*'"),
        (nn.ModuleList, ValueError, "a ModuleList, which is never called"),
        ("*", ValueError, "a ModuleList, which is never called"),
    ],
)
def test_bad_names_are_refused_before_anything_is_registered(names: object, error: type, match: str) -> None:
    model = Blocks()
    with pytest.raises(error, match=match):
        checkpoint_activations(model, names)  # type: ignore[arg-type]
    assert checkpointed(model) == []
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_the_names_a_container_refusal_suggests_keep_its_siblings_and_work() -> None:
    """'*' picks the ModuleList and its siblings: the fix names the list's modules and keeps the others."""
    import ast

    model = Blocks()
    picked = sorted(n for n, _ in model.named_children())
    with pytest.raises(ValueError, match=r"Name its modules: \[") as caught:
        checkpoint_activations(model, "*")
    fix = ast.literal_eval(str(caught.value).rsplit("Name its modules: ", 1)[1].rstrip("."))
    assert sorted(n.removesuffix(".*") for n in fix) == picked  # every module '*' picked, none lost
    checkpoint_activations(model, fix)
    done = set(checkpointed(model))
    assert done >= {n for n in picked if n != "blocks"} and "blocks.0" in done
    with pytest.raises(TypeError, match=r"uncheckpoint_activations\('model'\): model must be an nn.Module, "
                       r"got str\. Pass the model you gave checkpoint_activations"):
        uncheckpoint_activations("model")  # type: ignore[arg-type]


def test_a_checkpoint_inside_or_around_another_is_refused_and_nothing_changes() -> None:
    model = Blocks()
    checkpoint_activations(model, "blocks.1")
    with pytest.raises(
        SpeedupsError, match=r"'blocks\.1\.fc1' lies inside or around 'blocks\.1'.*uncheckpoint"
    ):
        checkpoint_activations(model, ["blocks.0", "blocks.1.fc1"])
    with pytest.raises(SpeedupsError, match=r"'' lies inside or around 'blocks\.1'"):
        checkpoint_activations(model, "")  # the model itself
    assert checkpointed(model) == ["blocks.1"]  # blocks.0 was not registered either
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        checkpoint_activations("model", "x")  # type: ignore[type-var]
    with pytest.raises(TypeError, match="enabled must be True or False"):
        checkpoint_activations(model, "blocks.0", enabled=1)  # type: ignore[arg-type]


def test_enabled_false_and_the_undo_leave_no_hook_and_the_plain_memory() -> None:
    model = Blocks()
    checkpoint_activations(model, "blocks.*", enabled=False)
    assert checkpointed(model) == []
    x = torch.randn(64, 3)

    def saved() -> SavedActivations:
        with SavedActivations(model) as counter:
            model(x).sum().backward()
        return counter

    plain = saved()
    checkpoint_activations(model, "blocks.*")
    less = saved()
    uncheckpoint_activations(model)
    again = saved()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert again.total_bytes == plain.total_bytes
    # each checkpointed block keeps its input (64 x 16 float32) and nothing else
    for name in ("blocks.0", "blocks.1", "blocks.2"):
        assert less.bytes_by_block[name] == 64 * 16 * 4 < plain.bytes_by_block[name]
    assert less.total_bytes < 0.3 * plain.total_bytes


def test_no_grad_and_eval_forwards_run_plainly() -> None:
    model = checkpoint_activations(Blocks(), "blocks.*").eval()
    with torch.no_grad():
        out = model(torch.ones(2, 3))
    assert out.grad_fn is None
    assert torch.equal(out, Blocks().eval()(torch.ones(2, 3)))


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_forward_that_raises_leaves_no_saved_tensors_hook_behind() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Boom())
    checkpoint_activations(model, "1")
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(2, 3, requires_grad=True))
    # the region closed: a later plain graph saves its tensors as usual (seen by a counter)
    lin = nn.Linear(3, 3)
    with SavedActivations(lin) as counter:
        lin(torch.ones(2, 3)).tanh().sum().backward()
    assert counter.total_bytes > 0 and counter.bytes_by_block[OUTSIDE] > 0


@pytest.mark.parametrize("mode", ["retain_graph", "gradient penalty"])
def test_a_second_backward_through_a_checkpointed_block_recomputes_again(mode: str) -> None:
    """Each backward through the block recomputes it (a fresh recompute context each time): gradients bit for
    bit the plain model's and torch.utils.checkpoint's by hand, BatchNorm statistics untouched."""

    def grads(kind: str) -> list[torch.Tensor]:
        model = Blocks(norm="batch", hand=kind == "hand")
        if kind == "ours":
            checkpoint_activations(model, "blocks.*")
        torch.manual_seed(3)
        x = torch.randn(8, 3, requires_grad=True)
        out = model(x).pow(2).sum()
        if mode == "retain_graph":
            out.backward(retain_graph=True)
            out.backward()
        else:  # a WGAN-GP style penalty: a backward through the gradient's graph
            (g,) = torch.autograd.grad(out, x, create_graph=True)
            (out + g.pow(2).sum()).backward()
        return [p.grad.clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]

    plain, ours = grads("plain"), grads("ours")
    assert_same(plain, ours)
    hand = grads("hand")
    assert_same(hand[: len(list(Blocks().parameters()))], ours[: len(list(Blocks().parameters()))])
