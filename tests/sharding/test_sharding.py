"""shard_model / unshard_model against the same model left on one device.

Without a GPU the devices are "cpu" and "meta": meta tensors have shapes and devices but no data, so those
tests check placement, hooks, and what reaches each submodule (recorded inside the submodule); values are
checked with an all-"cpu" sharding, which must match the plain model bitwise. CUDA tests run on a GPU
machine with `pytest -m cuda`.
"""

from __future__ import annotations

import copy
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, shard_model, unshard_model
from speedups.sharding import plan as sharding_plan
from tests._bench import run_quick

ROOT = Path(__file__).resolve().parents[2]
META, CPU = torch.device("meta"), torch.device("cpu")


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(self.lin(x)) * self.scale
        return h if mask is None else h * mask.unsqueeze(-1)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 3)])

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return (h * mask.unsqueeze(-1)).sum(1)


class EncoderDecoder(nn.Module):
    """A root-level parameter between two submodules, and a keyword mask both need."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.decoder = Decoder()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x, mask=mask) + self.pos
        return self.decoder(h, mask=mask)


def make_model(seed: int = 0) -> EncoderDecoder:
    torch.manual_seed(seed)
    return EncoderDecoder()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, 4, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    return x, mask, torch.randn(6, 3, generator=g)


def placement(model: nn.Module) -> dict[str, torch.device]:
    return {n: t.device for n, t in [*model.named_parameters(), *model.named_buffers()]}


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        name: (
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            len(m._state_dict_hooks),
            len(m._load_state_dict_pre_hooks),
        )
        for name, m in model.named_modules()
    }


# ------------------------------------------------------------------------------------------- placement
def test_placement_of_every_parameter_and_buffer_with_nested_keys() -> None:
    model = shard_model(make_model(), {"encoder": "meta", "decoder.layers.1": "meta"}, default_device="cpu")
    expected = {
        name: META if name.startswith(("encoder.", "decoder.layers.1.")) else CPU for name in placement(model)
    }
    assert placement(model) == expected
    assert model.encoder.scale.device == META and model.pos.device == CPU  # a buffer; a root parameter


def test_default_device_is_the_first_keys_device_unless_given() -> None:
    model = shard_model(make_model(), {"decoder": "meta", "encoder": "cpu"})
    assert model.pos.device == META and model.encoder.lin.weight.device == CPU
    model = shard_model(make_model(), {"encoder": "cpu"}, default_device="meta")
    assert model.pos.device == META and model.decoder.layers[0].weight.device == META
    assert model.encoder.lin.weight.device == CPU


# ------------------------------------------------------------------------------------------------ hooks
def test_hooks_are_registered_and_removed_by_unshard() -> None:
    model = make_model()
    before = hook_counts(model)
    assert shard_model(model, {"encoder": "cpu", "decoder": "cpu"}) is model
    after = hook_counts(model)
    for name in ("", "encoder", "decoder"):
        assert after[name][:2] == (before[name][0] + 1, before[name][1] + 1), name
    assert after["encoder.lin"] == before["encoder.lin"]  # only the mapped submodules and the root
    assert type(model.forward) is type(make_model().forward) and "forward" not in vars(model)

    assert unshard_model(model) is model
    assert hook_counts(model) == before
    assert not hasattr(model, "_speedups_sharding")
    assert set(placement(model).values()) == {CPU}
    shard_model(model, {"encoder": "cpu"})  # sharding again after undoing is allowed


def test_user_hooks_are_left_alone() -> None:
    model = make_model()
    seen = []
    model.encoder.register_forward_hook(lambda m, a, out: seen.append(out.device))
    shard_model(model, {"encoder": "cpu"})
    unshard_model(model)
    model(*batch()[:2])
    assert seen == [CPU]


def test_unshard_moves_everything_to_one_device() -> None:
    model = shard_model(make_model(), {"encoder": "meta"}, default_device="cpu")
    unshard_model(model, "meta")
    assert set(placement(model).values()) == {META}
    x, mask, _ = batch()
    assert model(x.to(META), mask.to(META)).device == META


# ------------------------------------------------------------------------------------ inputs and outputs
class Recorder(nn.Module):
    """Records the device and shape of every input it receives; returns a fresh CPU tensor of the input's
    shape (a meta module has no data to return)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.seen: list[tuple[torch.device, ...]] = []

    def forward(self, x: torch.Tensor, *, extra: dict) -> torch.Tensor:
        mask, (label, t) = extra["mask"], extra["pair"]
        assert label == "pair"  # non-tensors pass through
        self.seen.append((x.device, mask.device, t.device, self.weight.device))
        assert x.shape == (2, 4) and mask.shape == (2,) and t.shape == (3,)
        return torch.zeros(x.shape)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Recorder()
        self.bias = nn.Parameter(torch.zeros(4))
        self.second = Recorder()
        self.root_saw: list[torch.device] = []

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, pair: tuple) -> torch.Tensor:
        h = self.first(x, extra={"mask": mask, "pair": pair})
        self.root_saw.append(h.device)
        h = h + self.bias  # a root-level parameter consumes a mapped submodule's output
        return self.second(h, extra={"mask": mask, "pair": pair})


@pytest.mark.parametrize("first, second", [("meta", "cpu"), ("cpu", "meta")])
def test_positional_keyword_and_nested_inputs_reach_each_submodule_on_its_device(first, second) -> None:
    model = shard_model(Routed(), {"first": first, "second": second}, default_device="cpu")
    for _ in range(2):
        out = model(torch.ones(2, 4), mask=torch.ones(2), pair=("pair", torch.ones(3)))
        assert out.device == CPU and out.shape == (2, 4)
    dev1, dev2 = torch.device(first), torch.device(second)
    assert model.first.seen == [(dev1, dev1, dev1, dev1)] * 2
    assert model.second.seen == [(dev2, dev2, dev2, dev2)] * 2
    assert model.root_saw == [CPU, CPU]  # outputs come back to the default device


def test_a_mapped_submodules_output_comes_back_to_the_default_device() -> None:
    model = shard_model(make_model(), {"encoder": "cpu"}, default_device="meta")
    x, mask, _ = batch()
    h = model.encoder(x, mask=mask)  # runs on cpu, returns to where the unmapped code runs
    assert h.device == META and h.shape == (6, 5, 8)


def test_output_is_on_the_input_device_or_output_device_on_every_call() -> None:
    x, mask, _ = batch()
    model = shard_model(make_model(), {"encoder": "cpu", "decoder": "cpu"})
    assert [model(x, mask).device for _ in range(3)] == [CPU] * 3
    model = shard_model(make_model(), {"encoder": "cpu"}, output_device="meta")
    assert [model(x, mask=mask).device for _ in range(3)] == [META] * 3
    model = shard_model(make_model(), {"encoder": "meta", "decoder": "meta"})  # root on meta too
    out = model(x.to(META), mask=mask.to(META))
    assert out.device == META and out.shape == (6, 3)
    out = shard_model(make_model(), {"encoder": "meta"}, output_device="meta")(x, mask)  # cpu in, meta out
    assert out.device == META and out.shape == (6, 3)


# ------------------------------------------------------------------------------- values and training
def test_cpu_sharding_gives_bitwise_the_same_loss_grads_and_optimizer_steps() -> None:
    plain, sharded = make_model(), make_model()
    shard_model(sharded, {"encoder": "cpu", "decoder.layers.0": "cpu", "decoder.layers.1": "cpu"})
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-2)
    opt_sharded = torch.optim.Adam(sharded.parameters(), lr=1e-2)  # built after sharding
    for step in range(3):
        x, mask, y = batch(seed=step)
        losses = []
        for model, opt in ((plain, opt_plain), (sharded, opt_sharded)):
            loss = nn.functional.mse_loss(model(x, mask=mask), y)
            opt.zero_grad()
            loss.backward()
            losses.append(loss.detach())
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            if model is plain:
                plain_grads = grads
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
        torch.testing.assert_close(grads, plain_grads, rtol=0, atol=0)
    torch.testing.assert_close(
        dict(sharded.named_parameters()), dict(plain.named_parameters()), rtol=0, atol=0
    )


def test_state_dict_round_trips_between_placements() -> None:
    plain, sharded = make_model(0), make_model(1)
    shard_model(sharded, {"encoder": "cpu", "decoder": "cpu"})
    assert list(sharded.state_dict()) == list(plain.state_dict())
    sharded.load_state_dict(plain.state_dict())
    torch.testing.assert_close(sharded.state_dict(), plain.state_dict(), rtol=0, atol=0)
    other = make_model(2)
    other.load_state_dict(sharded.state_dict())
    torch.testing.assert_close(other.state_dict(), plain.state_dict(), rtol=0, atol=0)
    meta = shard_model(make_model(), {"encoder": "meta"}, default_device="cpu")
    assert list(meta.state_dict()) == list(plain.state_dict())
    with pytest.warns(UserWarning, match="no-op"):  # torch's note: meta parameters take no values
        meta.load_state_dict(plain.state_dict())  # copies into each parameter where it is
    assert meta.encoder.lin.weight.device == META
    torch.testing.assert_close(meta.pos, plain.pos, rtol=0, atol=0)


def test_a_sharded_model_pickles_and_deep_copies() -> None:
    model = shard_model(make_model(), {"encoder": "cpu", "decoder": "cpu"}, output_device="meta")
    x, mask, _ = batch()
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone(x, mask).device == META  # the hooks came along
        unshard_model(clone, "cpu")
        torch.testing.assert_close(clone(x, mask), make_model()(x, mask), rtol=0, atol=0)


# ------------------------------------------------------------------------- DataParallel replicas (CPU)
@pytest.fixture(params=["public hooks", "torch 2.4 fallback"])
def cpu_replicas(request, monkeypatch):
    """Replicated shards on CPU: nn.DataParallel without CUDA is a pass-through wrapper, so the wrapping,
    the state_dict keys and the unwrapping can be checked here; the device checks run under `cuda`."""
    if torch.cuda.is_available():
        pytest.skip("DataParallel is a pass-through only without CUDA; see the cuda tests")
    monkeypatch.setattr(sharding_plan, "_resolve_replicas", lambda key, value, said: (CPU,))
    if request.param == "torch 2.4 fallback":
        monkeypatch.delattr(nn.Module, "register_state_dict_post_hook", raising=False)  # absent before 2.5
        monkeypatch.delattr(nn.Module, "register_load_state_dict_pre_hook", raising=False)


def test_replicated_shard_keeps_unsharded_state_dict_keys_and_values(cpu_replicas) -> None:
    plain, model = make_model(0), make_model(1)
    shard_model(model, {"encoder": [0, 1], "decoder": "cpu"})
    assert isinstance(model.encoder, nn.DataParallel) and isinstance(model.encoder.module, Encoder)
    assert "encoder.module.lin.weight" in dict(model.named_parameters())
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    assert "encoder.lin" in state._metadata and not any(".module" in k for k in state._metadata)
    assert list(model.encoder.state_dict()) == list(plain.encoder.state_dict())
    model.load_state_dict(plain.state_dict())  # strict: every key found
    torch.testing.assert_close(model.state_dict(), plain.state_dict(), rtol=0, atol=0)
    x, mask, _ = batch()
    torch.testing.assert_close(model(x, mask), plain(x, mask), rtol=0, atol=0)

    unshard_model(model)
    assert type(model.encoder) is Encoder and list(model.state_dict()) == list(plain.state_dict())
    assert hook_counts(model) == hook_counts(make_model())


# ------------------------------------------------------------------------------------------ bad input
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight


def test_aliases_same_module_under_two_names() -> None:
    model = make_model()
    model.alias = model.encoder
    with pytest.raises(ValueError, match="same module object"):
        shard_model(model, {"encoder": "meta", "alias": "meta"})
    with pytest.raises(ValueError, match="same tensor"):  # the alias would stay on the default device
        shard_model(model, {"encoder": "meta"}, default_device="cpu")


BAD = [
    ({"encodr": "cpu"}, {}, ValueError, r"'encodr' is not a submodule .* Did you mean 'encoder'"),
    ({"zzz": "cpu"}, {}, ValueError, r"'encoder', 'encoder.lin', .*'decoder.layers.1'"),
    ({"": "cpu"}, {}, ValueError, "is the model itself"),
    ({"encoder": "cpu", "encoder.lin": "meta"}, {}, ValueError, "'encoder' and 'encoder.lin' overlap"),
    (
        {"decoder.layers.0": "cpu", "decoder": "meta"},
        {},
        ValueError,
        "'decoder' and 'decoder.layers.0' overlap",
    ),
    ({1: "cpu"}, {}, TypeError, "keys are dotted submodule names"),
    ({"encoder": None}, {}, TypeError, r"device_map\['encoder'\] is None"),
    ({"encoder": 1.5}, {}, TypeError, "a list of CUDA devices"),
    ({"encoder": True}, {}, TypeError, "is True"),
    ({"encoder": "cuda:99"}, {}, SpeedupsError, "not available on this machine. Available here: cpu, meta"),
    ({"encoder": 99}, {}, SpeedupsError, "Available here"),
    ({"encoder": "nonsense"}, {}, ValueError, "not a device name"),
    ({"encoder": []}, {}, ValueError, "empty list"),
    ({"encoder": ["cpu"]}, {}, ValueError, "CUDA devices only"),
    ({"encoder": [[0]]}, {}, TypeError, "lists do not nest"),
    ({"encoder": [99]}, {}, SpeedupsError, r"device_map\['encoder'\]\[0\]=99"),
    ({}, {}, ValueError, "is empty"),
    ({"encoder": "cpu"}, {"default_device": "cuda:99"}, SpeedupsError, "default_device"),
    ({"encoder": "cpu"}, {"output_device": "bogus"}, ValueError, "output_device"),
    ({"encoder": "cpu"}, {"enabled": "yes"}, TypeError, "enabled"),
]


@pytest.mark.parametrize("device_map, kwargs, error, match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_and_leaves_the_model_as_it_was(device_map, kwargs, error, match) -> None:
    model = shard_model(make_model(), {"encoder": "meta"}, enabled=False)  # enabled=False: untouched
    model.decoder.layers[1].to(META)  # a model that is already spread over two devices
    before, hooks = placement(model), hook_counts(model)
    with pytest.raises(error, match=match) as info:
        shard_model(model, device_map, **kwargs)
    assert "shard_model(" in str(info.value)
    assert placement(model) == before and hook_counts(model) == hooks
    assert not hasattr(model, "_speedups_sharding") and type(model.encoder) is Encoder


@pytest.mark.parametrize(
    "make, device_map, error, match",
    [
        (Tied, {"embed": "meta"}, ValueError, r"'embed.weight' and 'out.weight' are the same tensor"),
        (lambda: make_model().to(META), {"encoder": "cpu"}, SpeedupsError, "to_empty"),
        (lambda: make_model().to(META), {"encoder": "meta"}, SpeedupsError, "'pos' is on 'meta'"),
        (lambda: shard_model(make_model(), {"encoder": "cpu"}), {"decoder": "cpu"}, SpeedupsError, "already"),
    ],
    ids=["tied-weights", "meta-to-cpu", "meta-default", "already-sharded"],
)
def test_bad_model_state_raises_and_changes_nothing(make, device_map, error, match) -> None:
    model = make()
    before, hooks = placement(model), hook_counts(model)
    sharded_before = getattr(model, "_speedups_sharding", None)
    with pytest.raises(error, match=match):
        shard_model(model, device_map, default_device="cpu")
    assert placement(model) == before and hook_counts(model) == hooks
    assert getattr(model, "_speedups_sharding", None) is sharded_before


def test_a_meta_model_can_be_sharded_on_meta_and_tied_weights_on_one_device() -> None:
    model = make_model().to(META)
    shard_model(model, {"encoder": "meta"})  # the default device is the first key's: meta
    assert set(placement(model).values()) == {META}
    tied = shard_model(Tied(), {"embed": "meta"})
    assert tied.out.weight is tied.embed.weight and tied.out.weight.device == META


def test_a_submodule_that_is_already_sharded_is_refused() -> None:
    model = make_model()
    shard_model(model.decoder, {"layers.0": "cpu"})
    with pytest.raises(
        SpeedupsError, match=r"model.decoder is already sharded.*unshard_model\(model.decoder\)"
    ):
        shard_model(model, {"encoder": "cpu"})


def test_model_and_device_map_types() -> None:
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        shard_model("model", {"encoder": "cpu"})
    with pytest.raises(TypeError, match="must be a dict"):
        shard_model(make_model(), [("encoder", "cpu")])


def test_unshard_errors_change_nothing() -> None:
    with pytest.raises(SpeedupsError, match="not sharded"):
        unshard_model(make_model())
    model = shard_model(make_model(), {"encoder": "meta"}, default_device="cpu")
    before, hooks = placement(model), hook_counts(model)
    with pytest.raises(SpeedupsError, match="to_empty"):
        unshard_model(model, "cpu")
    with pytest.raises(SpeedupsError, match="Available here"):
        unshard_model(model, "cuda:99")
    assert placement(model) == before and hook_counts(model) == hooks and hasattr(model, "_speedups_sharding")


def test_enabled_false_is_a_no_op() -> None:
    model = make_model()
    hooks = hook_counts(model)
    assert shard_model(model, {"not even a key": "cuda:99"}, enabled=False) is model
    assert hook_counts(model) == hooks and not hasattr(model, "_speedups_sharding")


# ------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_encoder_cpu_decoder_matches_a_cpu_reference() -> None:
    reference, model = make_model(), make_model()
    shard_model(model, {"encoder": "cuda:0", "decoder": "cpu"})
    assert (
        model.encoder.lin.weight.is_cuda and model.pos.is_cuda and not model.decoder.layers[0].weight.is_cuda
    )
    x, mask, y = batch()
    out = model(x, mask=mask)  # no device error: the mask follows the encoder and the decoder
    assert out.device == CPU
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    ref_loss = nn.functional.mse_loss(reference(x, mask=mask), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(
        {k: v.cpu() for k, v in model.state_dict().items()}, reference.state_dict(), rtol=0, atol=0
    )
    unshard_model(model)
    assert set(placement(model).values()) == {CPU}


@pytest.mark.cuda
def test_cuda_replicas_on_one_gpu_train_and_keep_state_dict_keys() -> None:
    reference, model = make_model(), make_model()
    shard_model(model, {"encoder": [0], "decoder": "cpu"}, default_device="cuda:0")
    assert isinstance(model.encoder, nn.DataParallel)
    assert list(model.state_dict()) == list(reference.state_dict())
    x, mask, y = batch()
    loss = nn.functional.mse_loss(model(x, mask=mask), y)
    loss.backward()
    ref = nn.functional.mse_loss(reference(x, mask=mask), y)
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref, rtol=0, atol=1e-5)
    grads = {n.replace("module.", ""): p.grad.cpu() for n, p in model.named_parameters()}
    torch.testing.assert_close(grads, {n: p.grad for n, p in reference.named_parameters()}, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="twice"):
        shard_model(make_model(), {"encoder": [0, 0]})
    unshard_model(model)
    assert type(model.encoder) is Encoder


# ---------------------------------------------------------------------------------- example, benchmark
@pytest.mark.slow
def test_example_runs_on_cpu_and_says_why() -> None:
    out = subprocess.run(
        [sys.executable, "examples/shard_encoder_decoder.py", "--steps", "30", "--cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "CPU devices" in out.stdout
    losses = [float(v) for v in re.findall(r"loss=([\d.]+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "state_dict round trip: ok" in out.stdout


@pytest.mark.slow
def test_benchmark_quick_mode_prints_its_table() -> None:
    stdout = run_quick("sharding", timeout=300)
    assert "ratio to plain" in stdout and "sharded cpu/cpu" in stdout


def test_a_submodule_of_a_sharded_model_cannot_be_sharded_again() -> None:
    class W(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = W()
    shard_model(model, {"inner.0": "cpu"})
    hooks = len(model.inner[0]._forward_pre_hooks)
    with pytest.raises(SpeedupsError, match="submodule of a sharded model"):
        shard_model(model.inner, {"0": "cpu"})
    assert len(model.inner[0]._forward_pre_hooks) == hooks
    unshard_model(model)
    assert not model.inner[0]._forward_pre_hooks
    shard_model(model.inner, {"0": "cpu"})  # allowed once the parent is unsharded
    unshard_model(model.inner)
