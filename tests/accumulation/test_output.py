"""Steps that return more than a loss: a mapping comes back with the loss detached and its extras intact."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from speedups import accumulate
from speedups._helpers.oom import is_out_of_memory


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_mapping_comes_back_detached_with_every_extra(micro_batch_size) -> None:
    model, opt = _setup()
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))

    @accumulate(1, opt, micro_batch_size=micro_batch_size)
    def train_step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        return OrderedDict(loss=loss, num_items=len(y), logits=logits, rows=len(y), note="n")

    out = train_step(x, y)
    logits = ref(x)
    ref_loss = F.cross_entropy(logits, y)
    assert type(out) is OrderedDict and list(out) == ["loss", "num_items", "logits", "rows", "note"]
    torch.testing.assert_close(out["loss"], ref_loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out["logits"], logits.detach(), atol=1e-6, rtol=0)  # concatenated in order
    assert not out["loss"].requires_grad and not out["logits"].requires_grad
    assert out["num_items"] == 5 and out["note"] == "n"
    assert out["rows"] == (5 if micro_batch_size is None else 1)  # not a tensor: the last micro-batch's
    ref_loss.backward()
    torch.testing.assert_close(
        model.weight.detach(), ref.weight.detach() - 0.1 * ref.weight.grad, atol=1e-6, rtol=0
    )


def test_mapping_without_num_items_weighs_like_a_bare_loss() -> None:
    results = []
    for form in ("bare", "mapping"):
        model, opt = _setup()

        @accumulate(2, opt)
        def train_step(x, y, form=form, model=model):
            loss = F.mse_loss(model(x), y)
            return loss if form == "bare" else {"loss": loss, "hidden": torch.ones(1)}

        for n in (4, 2, 3, 5):
            out = train_step(torch.ones(n, 3) * n, torch.zeros(n, 2))
        results.append(model.weight.detach().clone())
        assert form == "bare" or torch.equal(out["hidden"], torch.ones(1))
    assert torch.equal(results[0], results[1])


def test_mapping_without_loss_is_refused_before_any_backward() -> None:
    model, opt = _setup()

    @accumulate(1, opt)
    def train_step(x):
        return {"logits": model(x)}

    with pytest.raises(TypeError, match=r"no 'loss'.*Return \{'loss': loss"):
        train_step(torch.ones(2, 3))
    assert model.weight.grad is None


def test_tuple_and_bare_loss_keep_working() -> None:
    model, opt = _setup()
    step = accumulate(1, opt)(lambda x: (model(x).sum(), torch.tensor(2)))
    loss, n = step(torch.ones(2, 3))
    assert not loss.requires_grad and int(n) == 2
    step = accumulate(1, opt)(lambda x: model(x).sum())
    assert isinstance(step(torch.ones(2, 3)), torch.Tensor)


def test_out_of_memory_rule() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(KeyError("out of memory"))
