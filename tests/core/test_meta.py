"""materialise: only the tensors asked for become real, in every holder; init_fn per owning module; what init leaves
unset (wholly or partly, in place or through .data) is found; tensors init_fn assigns are adopted; release."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple.core.meta import default_init, is_meta_model, materialise, meta_left, release, reset_parameters

CPU = torch.device("cpu")


class Rotary(nn.Module):
    """A buffer computed in __init__ (lost on the meta device), recomputed by reset_parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", self.compute(), persistent=False)

    @staticmethod
    def compute(device=None) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, 8, 2, device=device).float() / 8)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self.compute(self.inv_freq.device))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.a, self.b = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        self.b.weight = self.embed.weight  # tied
        self.norm, self.rotary = nn.LayerNorm(4), Rotary()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


def meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def test_only_the_wanted_tensors_become_real_in_every_holder():
    model = meta_net()
    other = nn.ModuleDict({"a": nn.Module()})  # a second holder of one tensor, as a stage module is
    other["a"].register_parameter("w", model.a.weight)
    done = materialise(model, [model.a.weight, model.a.bias], [model, other], CPU, reset_parameters, where="t")
    assert not model.a.weight.is_meta and other["a"].w is model.a.weight and not model.a.bias.is_meta
    assert model.embed.weight.is_meta and model.rotary.inv_freq.is_meta and is_meta_model(model)
    assert done.nbytes == 20 * 4
    release(done, [model, other])
    assert model.a.weight.is_meta and other["a"].w is model.a.weight


def test_default_init_recomputes_the_buffer_and_the_tied_weight_is_one_tensor():
    model = meta_net()
    materialise(model, [*model.parameters(), model.rotary.inv_freq], [model], CPU, reset_parameters, where="t")
    assert model.b.weight is model.embed.weight and meta_left(model) == ["steps"]  # not asked for
    assert torch.equal(model.rotary.inv_freq, Rotary.compute()) and torch.equal(model.norm.weight, torch.ones(4))


def test_a_tensor_left_unset_is_named():
    model = meta_net()
    model.register_parameter("free", nn.Parameter(torch.empty(3, device="meta")))  # no module initialises it
    with pytest.raises(ValueError, match=r"'free', 'steps' were built on the meta device") as e:
        materialise(model, [*model.parameters(), *model.buffers()], [model], CPU, reset_parameters, where="here")
    assert str(e.value).startswith("here: ") and "'a.weight'" not in str(e.value)


def test_partly_set_is_unset_and_data_writes_count():
    model = meta_net()

    def half(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight.data[:2].normal_()  # .data: no version bump, found by the sentinel
            m.bias.data.zero_()

    with pytest.raises(ValueError, match=r"'a.weight' was built"):
        materialise(model, [model.a.weight, model.a.bias], [model], CPU, half, where="t")
    model = meta_net()
    materialise(model, [model.a.weight, model.a.bias], [model], CPU, lambda m: m.reset_parameters(), where="t")
    assert torch.isfinite(model.a.weight).all()


def test_tensors_init_fn_assigns_are_adopted_and_fill_gives_numbers():
    model = meta_net()

    def assign(m: nn.Module) -> None:
        if isinstance(m, Rotary):
            m.inv_freq = Rotary.compute()  # a new tensor (here on the CPU, in general on any device)

    done = materialise(model, [model.rotary.inv_freq, model.norm.weight], [model], CPU, assign, where="t",
                       fill=True)
    assert torch.equal(model.rotary.inv_freq, Rotary.compute()) and torch.isfinite(model.norm.weight).all()
    assert done.real[next(iter(done.real))] is not None and len(done.meta) == 2


def test_init_fn_errors_name_the_module():
    model = meta_net()

    def broken(m: nn.Module) -> None:
        raise KeyError("nope")

    with pytest.raises(RuntimeError, match=r"init_fn on module 'a' \(Linear\) failed: KeyError"):
        materialise(model, [model.a.weight], [model], CPU, broken, where="t")


def test_default_init_is_a_transformers_models_own():
    class Pretrained(Net):
        config = object()

        def _init_weights(self, module: nn.Module) -> None:
            pass

    assert default_init(Net()) is reset_parameters
    hf = Pretrained()
    assert default_init(hf) == hf._init_weights
