"""One rule for model wrappers: DDP (a 1-process gloo group), DataParallel and torch.compile, any order."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from speedups._helpers import wrappers as _wrappers
from tests._dist import free_port


@pytest.fixture
def one_process_group():
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_any_nesting_of_ddp_and_compile_unwraps_to_the_plain_module(one_process_group) -> None:
    plain = nn.Linear(3, 2)
    ddp = DistributedDataParallel(plain)
    compiled_outside = torch.compile(ddp)  # the order PyTorch recommends
    compiled_inside = DistributedDataParallel(torch.compile(nn.Linear(3, 2)))
    assert _wrappers.unwrap(compiled_outside) is plain
    assert _wrappers.find_ddp(compiled_outside) is ddp
    assert isinstance(_wrappers.find_ddp(compiled_inside), DistributedDataParallel)
    assert isinstance(_wrappers.unwrap(compiled_inside), nn.Linear)
    assert _wrappers.find_ddp(torch.compile(plain)) is None
    assert [type(m).__name__ for m in _wrappers.layers(compiled_outside)] == [
        "OptimizedModule",
        "DistributedDataParallel",
        "Linear",
    ]
    keys = compiled_outside.state_dict().keys()
    assert list(keys) == ["_orig_mod.module.weight", "_orig_mod.module.bias"]
    assert list(_wrappers.strip_prefixes(compiled_outside.state_dict())) == ["weight", "bias"]


def test_data_parallel_and_plain_modules() -> None:
    plain = nn.Linear(3, 2)
    assert _wrappers.unwrap(plain) is plain and _wrappers.find_ddp(plain) is None
    assert _wrappers.unwrap(DataParallel(plain)) is plain


def test_strip_prefixes_keeps_a_real_child_named_module() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = Holder()
    own = holder.state_dict()
    assert list(_wrappers.strip_prefixes(own, expected=own)) == ["module.weight", "module.bias"]
    wrapped = DataParallel(holder).state_dict()  # module.module.weight
    assert list(_wrappers.strip_prefixes(wrapped, expected=own)) == ["module.weight", "module.bias"]
    assert _wrappers.strip_prefixes({}) == {}
    mixed = {"module.a": 1, "b": 2}
    assert _wrappers.strip_prefixes(mixed) == mixed


def test_live_wrapper_of_finds_a_ddp_like_wrapper_and_asks_no_dead_proxy() -> None:
    """The scan of live objects meets weakref proxies whose referent died (they raise on any question)."""
    import gc
    import weakref

    from speedups._helpers.wrappers import live_wrapper_of

    class Thing:
        pass

    thing = Thing()
    dead = weakref.proxy(thing)  # tracked by gc through the list below
    keep = [dead]
    del thing
    gc.collect()
    model = nn.Linear(2, 2)
    wrapper = nn.DataParallel(model)
    ids = {id(p) for p in model.parameters()}
    assert live_wrapper_of(ids) is wrapper
    assert live_wrapper_of(ids, (nn.parallel.DistributedDataParallel,)) is None
    assert live_wrapper_of({id(object())}) is None
    del keep
