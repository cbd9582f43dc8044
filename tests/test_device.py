"""to_device / default_device / resolve_device against plain torch.Tensor.to."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict, UserDict, defaultdict, deque
from typing import NamedTuple

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, SpeedupsWarning, default_device, resolve_device, to_device

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    ids: list[str]


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    name: str
    derived: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.derived = f"from-{self.name}"


@dataclasses.dataclass(frozen=True)
class Frozen:
    t: torch.Tensor
    k: int = 3


class Batch(UserDict):
    pass


class TaggedDict(dict):
    """A dict subclass with an attribute, as feature batches of some libraries are."""


class MoveMe:
    """Not a container; has a `.to` method."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> MoveMe:
        return MoveMe(self.t.to(device))


def test_nested_batch_to_meta_keeps_types_and_leaves_input_alone() -> None:
    dd = defaultdict(list, x=torch.ones(2))
    batch = {
        "nt": Pair(x=torch.randn(3), ids=["a"]),
        "dc": Sample(torch.zeros(2, 2), "s"),
        "dd": dd,
        "t": (torch.arange(4),),
    }
    moved = to_device(batch, META)

    assert type(moved) is dict and moved is not batch
    assert type(moved["nt"]) is Pair and moved["nt"].x.device == META and moved["nt"].ids == ["a"]
    assert type(moved["dc"]) is Sample and moved["dc"].image.device == META
    assert moved["dc"].name == "s" and moved["dc"].derived == "from-s"
    assert type(moved["dd"]) is defaultdict and moved["dd"].default_factory is list
    assert moved["dd"]["x"].device == META
    assert type(moved["t"]) is tuple and moved["t"][0].device == META
    assert moved["t"][0].dtype == torch.int64 and moved["dc"].image.shape == (2, 2)
    # the input batch is untouched
    assert batch["nt"].x.device.type == "cpu" and batch["dc"].image.device.type == "cpu"
    assert batch["dd"]["x"].device.type == "cpu" and batch["t"][0].device.type == "cpu"
    assert "missing" not in batch["dd"]


@pytest.mark.parametrize(
    "make, get",
    [
        (lambda t: OrderedDict(b=t, a=t), lambda o: o["a"]),
        (lambda t: Batch(a=t), lambda o: o["a"]),
        (lambda t: [t, [t]], lambda o: o[1][0]),
        (lambda t: (t, "s", None, 3), lambda o: o[0]),
        (lambda t: Frozen(t), lambda o: o.t),
        (lambda t: MoveMe(t), lambda o: o.t),
    ],
    ids=["OrderedDict", "UserDict", "list", "tuple", "frozen-dataclass", "dot-to-object"],
)
def test_every_container_kind_keeps_its_type(make, get) -> None:
    original = make(torch.ones(3))
    moved = to_device(original, META)
    assert type(moved) is type(original)
    assert get(moved).device == META
    assert get(original).device.type == "cpu"


def test_ordered_dict_keeps_order_and_dict_subclass_keeps_attributes() -> None:
    od = to_device(OrderedDict(b=torch.ones(1), a=torch.ones(1)), META)
    assert list(od) == ["b", "a"]
    tagged = TaggedDict(x=torch.ones(1))
    tagged.note = "keep me"
    moved = to_device(tagged, META)
    assert type(moved) is TaggedDict and moved.note == "keep me" and moved["x"].device == META


def test_module_moves_in_place_like_nn_module_to() -> None:
    model = nn.Linear(2, 2)
    out = to_device({"m": model}, META)
    assert out["m"] is model and model.weight.device == META


def test_values_are_equal_after_a_cpu_move() -> None:
    t = torch.randn(4, 5)
    moved = to_device({"t": t}, "cpu")
    torch.testing.assert_close(moved["t"], t, rtol=0, atol=0)


def test_non_blocking_defaults_to_false_off_cuda(monkeypatch) -> None:
    seen = []
    original_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("non_blocking"))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    to_device(torch.ones(1), META)
    to_device(torch.ones(1), META, non_blocking=True)
    assert seen == [False, True]


def test_default_device_on_this_machine() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        expected = "mps"
    assert default_device().type == expected
    assert resolve_device(None) == default_device()


def test_default_device_uses_local_rank_not_rank(monkeypatch) -> None:
    """A8: RANK=5 LOCAL_RANK=1 with 4 mocked GPUs is cuda:1."""
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(SpeedupsError, match=r"LOCAL_RANK=4 .* 4 CUDA device"):
        default_device()


@pytest.mark.parametrize("bad", ["cuda:7", "mps" if not torch.backends.mps.is_available() else "cuda:99"])
def test_missing_device_names_what_is_available(bad) -> None:
    batch = {"x": torch.ones(1)}
    with pytest.raises(SpeedupsError, match=rf"to_device\(device='{bad}'\).*Available here: cpu, meta"):
        to_device(batch, bad)
    assert batch["x"].device.type == "cpu"


def test_nonsense_device_and_wrong_types() -> None:
    with pytest.raises(ValueError, match=r"'nonsense' is not a device name.*Available here"):
        to_device(torch.ones(1), "nonsense")
    with pytest.raises(TypeError, match=r"device=2.5"):
        to_device(torch.ones(1), 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"non_blocking='yes'"):
        to_device(torch.ones(1), "cpu", non_blocking="yes")  # type: ignore[arg-type]


def test_int_device_is_a_cuda_index() -> None:
    if torch.cuda.is_available():
        assert resolve_device(0) == torch.device("cuda", 0)
    else:
        with pytest.raises(SpeedupsError, match="device=0"):
            resolve_device(0)


@pytest.mark.cuda
def test_pinned_tensor_to_cuda_is_non_blocking_and_correct() -> None:
    t = torch.randn(1000).pin_memory()
    moved = to_device({"t": t})
    torch.cuda.synchronize()
    assert moved["t"].device.type == "cuda"
    torch.testing.assert_close(moved["t"].cpu(), t, rtol=0, atol=0)


def test_objects_that_move_themselves_are_not_taken_apart() -> None:
    packed = nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])  # a namedtuple with .to
    moved = to_device({"seq": packed}, "cpu")
    assert type(moved["seq"]) is type(packed) and moved["seq"].batch_sizes.device.type == "cpu"
    torch.testing.assert_close(moved["seq"].data, packed.data, rtol=0, atol=0)
    calls = []

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

        def to(self, device: torch.device) -> Batch:
            calls.append(device)
            return Batch(self.x.to(device))

    out = to_device([Batch(torch.ones(2))], META)
    assert calls == [META] and out[0].x.device == META


def test_a_batch_that_contains_itself_is_a_clear_error() -> None:
    batch: list = [torch.ones(1)]
    batch.append(batch)
    with pytest.raises(ValueError, match="contains itself"):
        to_device(batch, META)


# ------------------------------------------------------------------------------ deques, sets, plain objects
def test_deque_and_sets_are_walked_keeping_their_type_and_maxlen() -> None:
    t = torch.arange(3.0)
    batch = {"window": deque([t, {"y": t * 2}], maxlen=5), "ids": frozenset({"a"}), "s": {t}}
    moved = to_device(batch, "meta")
    window = moved["window"]
    assert type(window) is deque and window.maxlen == 5 and window is not batch["window"]
    assert window[0].device.type == "meta" and window[1]["y"].device.type == "meta"
    assert moved["ids"] == frozenset({"a"}) and type(moved["ids"]) is frozenset
    assert type(moved["s"]) is set and next(iter(moved["s"])).device.type == "meta"
    assert batch["window"][0] is t and t.device.type == "cpu"  # the input is left alone
    back = to_device(to_device(deque([t]), "cpu"), "cpu")
    assert torch.equal(back[0], t)


def test_a_plain_object_holding_tensors_warns_once_naming_its_class() -> None:
    class Batch:  # a hand-written batch class: no .to(), not a dataclass
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x
            self.name = "b"

    class Slotted:
        __slots__ = ("y",)

        def __init__(self, y: torch.Tensor) -> None:
            self.y = y

    with pytest.warns(SpeedupsWarning, match=r"a test_a_plain.*Batch holds tensors \(x\).*dataclass") as rec:
        out = to_device(Batch(torch.ones(2)), "meta")
    assert len(rec) == 1 and out.x.device.type == "cpu"  # left where it was, and said so
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_device([Batch(torch.ones(2))], "meta")  # once per class
        to_device({"n": 3, "f": 0.5, "none": None, "r": range(2)}, "meta")  # plain leaves: silent
    with pytest.warns(SpeedupsWarning, match=r"Slotted holds tensors \(y\)"):
        to_device({"b": Slotted(torch.ones(1))}, "meta")
