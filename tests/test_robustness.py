"""Issue #20: random token selection under recomputation and resume, empty batches, and clear
errors from the layers' constructors. The ops' edge rules on every backend are in
tests/test_robustness_triton.py (kernels) and tests/test_errors.py. Also: the CUDA extensions' build
folders and a build's left lock."""
import os
import re
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from turbomoe.nn import MoELayer


def rts_layer(seed=0, **kw):
    """A layer whose experts are over-full (capacity 0.5), so RTS drops routes."""
    torch.manual_seed(3)
    return MoELayer(16, 24, 4, 2, capacity_factor=0.5, drop_policy="rts", seed=seed, dtype=torch.float64, **kw)


def step(layer, x, rng_seed, ckpt=None):
    """Forward + backward from a fixed torch RNG state: out, aux, dx and every parameter's gradient."""
    layer.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    torch.manual_seed(rng_seed)
    out, aux = layer(xa) if ckpt is None else checkpoint(layer, xa, use_reentrant=ckpt == "reentrant")
    (out.square().sum() + aux).backward()
    return [out.detach(), aux.detach(), xa.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_rts_gradients_equal_under_activation_checkpointing(ckpt):
    """The recomputed forward must drop the same routes as the first one (failed before: the layer
    advanced its seed on every training forward, so the recompute re-routed; dx off by 0.19)."""
    layer = rts_layer()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    plain, recomputed = step(layer, x, 1), step(layer, x, 1, ckpt)
    assert (layer.expert_load.sum() < 2 * 26)  # routes were dropped, so the selection matters
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)


def test_rts_selection_changes_each_step_and_resumes_from_state_dict():
    """Training draws a fresh selection each step from torch's CPU generator mixed with `seed`; a
    module restored from the state dict, with torch's RNG state restored, continues the same stream
    (failed before: seed was not in the state dict)."""
    layer = rts_layer(seed=11)
    x = torch.randn(26, 16, dtype=torch.float64)
    torch.manual_seed(5)
    loads = [layer(x)[0].detach() for _ in range(3)]
    assert not torch.equal(loads[0], loads[1])  # a new random selection each step
    state, rng = layer.state_dict(), torch.get_rng_state()
    assert state["_extra_state"] == {"seed": 11}
    expected = layer(x)[0].detach()
    resumed = rts_layer(seed=0)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert resumed.seed == 11 and torch.equal(resumed(x)[0].detach(), expected)
    layer.eval()  # eval: `seed` alone, the same selection every call
    assert torch.equal(layer(x)[0], layer(x)[0])


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0), dict(capacity_factor=1.0, min_capacity=0),
                                dict(drop_policy="rts", capacity_factor=2.0, shared_ffn_hidden_size=8)])
def test_layer_on_an_empty_batch(kw):
    """S = 0: an empty output and a zero loss (failed before: the reference's aux and z losses
    divided by S = 0 and the layer returned a NaN loss)."""
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 4, 2, z_loss_coef=0.1, **kw)
    x = torch.randn(3, 0, 16, requires_grad=True)
    out, loss = layer(x)
    assert out.shape == (3, 0, 16) and loss.item() == 0.0
    (out.sum() + loss).backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in layer.parameters())


@pytest.mark.parametrize("kw,error,match", [
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(hidden_size=16.0), TypeError, "hidden_size"),
    (dict(ffn_hidden_size=-1), ValueError, "ffn_hidden_size"),
    (dict(num_experts=True), TypeError, "num_experts"),
    (dict(k=5), ValueError, "k must be"),
    (dict(min_capacity=-3), ValueError, "min_capacity"),
    (dict(capacity_factor=True), TypeError, "capacity_factor"),  # wrong types: TypeErrors, as check_int's
    (dict(capacity_factor="1.0"), TypeError, "capacity_factor"),
    (dict(capacity_factor=float("inf")), ValueError, "capacity_factor"),
    (dict(aux_loss_coef="0.01"), TypeError, "aux_loss_coef"),
    (dict(z_loss_coef=float("nan")), ValueError, "z_loss_coef"),
    (dict(renormalize="yes"), TypeError, "renormalize"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=None), TypeError, "seed"),
    (dict(seed="7"), TypeError, "seed"),
    (dict(shared_ffn_hidden_size=-8), ValueError, "shared_ffn_hidden_size"),
])
def test_layer_constructor_errors(kw, error, match):
    """Bad arguments raise at construction, naming the argument (failed before: hidden_size=0 raised
    ZeroDivisionError, min_capacity=-3 only at forward, seed=1.5 an internal TypeError at forward)."""
    args = dict(dict(hidden_size=16, ffn_hidden_size=24, num_experts=4, k=2), **kw)
    with pytest.raises(error, match=match):
        MoELayer(**args)


def test_load_state_dict_rejects_a_bad_seed():
    layer = rts_layer()
    state = layer.state_dict()
    state["_extra_state"] = {"seed": "7"}
    with pytest.raises(TypeError, match="seed"):
        layer.load_state_dict(state)


def test_load_state_dict_saved_before_the_seed_was():
    """A state dict without the layer's extra state (saved by an older turbomoe) still loads with
    strict=True: the layer keeps its own seed."""
    layer = rts_layer(seed=3)
    state = {k: v for k, v in layer.state_dict().items() if not k.endswith("_extra_state")}
    fresh = rts_layer(seed=5)
    fresh.load_state_dict(state)
    assert fresh.seed == 5
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), layer.state_dict().values())
               if isinstance(a, torch.Tensor))


def test_extension_builds_in_a_folder_of_its_checkout(monkeypatch, tmp_path):
    """Two checkouts (an A/B of two commits) build in folders of their own, so switching between them
    rebuilds nothing; the same checkout finds its folder again; TORCH_EXTENSIONS_DIR is honoured."""
    from turbomoe import csrc
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    a = csrc.build_directory("turbomoe_gmm", "/x/a/turbomoe/csrc")
    b = csrc.build_directory("turbomoe_gmm", "/x/b/turbomoe/csrc")
    assert a != b and a == csrc.build_directory("turbomoe_gmm", "/x/a/turbomoe/csrc")
    assert os.path.dirname(a) == str(tmp_path) and os.path.basename(a).startswith("turbomoe_gmm_")
    assert csrc.build_directory("turbomoe_cuda", "/x/a/turbomoe/csrc") != a


def test_extension_build_warns_of_a_left_lock(monkeypatch, tmp_path):
    """torch waits without end and without a word on a build's lock; a build killed by a signal leaves
    it (the hang this guards: a timed-out build blocked every later process on the GPU machine). The
    load says which file it waits on and what to do; it calls torch's build with that folder."""
    import torch.utils.cpp_extension as cpp
    from turbomoe import csrc
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or "module")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no lock yet: no warning
        assert csrc._load("turbomoe_cuda", csrc._SOURCES, "the CUDA backend") == "module"
    folder = calls[0]["build_directory"]
    assert os.path.isdir(folder) and calls[0]["name"] == "turbomoe_cuda"
    assert all(os.path.isfile(s) for s in calls[0]["sources"])
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    with pytest.warns(UserWarning, match=f"build of the CUDA backend .*{re.escape(lock)}.* delete that file"):
        csrc._load("turbomoe_cuda", csrc._SOURCES, "the CUDA backend")
    assert calls[1]["build_directory"] == folder
