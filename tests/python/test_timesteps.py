"""posenc.Timesteps: diffusers' Timesteps module (constructor num_channels, flip_sin_to_cos,
downscale_freq_shift, scale=1; forward(timesteps)) over the timestep_embedding op, plus
max_period. No parameters or buffers, as in diffusers. The C++ posenc::Timesteps:
tests/cpp/test_learned.cpp (TimestepsModule.ForwardIsTheFunction)."""


import pytest
import torch

import posenc
from posenc.functional import timestep_embedding

from conftest import DEVICES
from timestep_reference import diffusers_float32, diffusers_float64


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


# diffusers' usual settings: DiT / PixArt / SD3 (256, True, 0), the SD UNet (320, True, 0),
# DDPM-style (128, False, 1), an odd width, a scaled and re-periodised one.
CONFIGS = [
    dict(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0),
    dict(num_channels=320, flip_sin_to_cos=True, downscale_freq_shift=0),
    dict(num_channels=128, flip_sin_to_cos=False, downscale_freq_shift=1),
    dict(num_channels=33, flip_sin_to_cos=True, downscale_freq_shift=1, scale=1000),
    dict(num_channels=64, flip_sin_to_cos=False, downscale_freq_shift=0.5, scale=2.5, max_period=500),
    dict(num_channels=1, flip_sin_to_cos=False, downscale_freq_shift=0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS)
def test_forward_matches_diffusers_formula(device, config):
    m = posenc.Timesteps(**config).to(device)
    t = torch.rand(17, device=device) * 1000
    got = m(t)
    assert got.shape == (17, config["num_channels"]) and got.dtype == torch.float32 and got.device == t.device
    settings = {k: v for k, v in config.items() if k != "num_channels"}
    # diffusers' float32 operations in the same order on the same device: bit for bit.
    assert torch.equal(got, diffusers_float32(t, config["num_channels"], **settings))
    # And the float64 formula, to float32 accuracy (the angles are float32).
    exact, angles = diffusers_float64(t, config["num_channels"], **settings)
    atol = 4 * angles.abs().max().item() * 2.0**-24 + 1e-6 if angles.numel() else 0.0
    torch.testing.assert_close(got.cpu().double(), exact, atol=atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_is_the_function(device):
    for config in CONFIGS:
        m = posenc.Timesteps(**config)
        kwargs = {k: v for k, v in config.items() if k != "num_channels"}
        for t in (torch.rand(5, device=device) * 1000, torch.arange(0, 1000, 99, device=device),
                  torch.rand(3, device=device, dtype=torch.float64), torch.empty(0, device=device)):
            assert bits_equal(m(t), timestep_embedding(t, config["num_channels"], **kwargs))


def test_no_parameters_or_buffers():
    m = posenc.Timesteps(256, True, 0)
    assert list(m.parameters()) == [] and list(m.buffers()) == [] and m.state_dict() == {}
    m.load_state_dict({})  # a diffusers checkpoint holds nothing for it
    assert list(m.children()) == []


def test_constructor_is_diffusers():
    m = posenc.Timesteps(320, True, 0)  # diffusers' positional form
    assert (m.num_channels, m.flip_sin_to_cos, m.downscale_freq_shift, m.scale, m.max_period) == (320, True, 0, 1, 10000)
    m = posenc.Timesteps(num_channels=8, flip_sin_to_cos=False, downscale_freq_shift=1, scale=3, max_period=50)
    # The real settings held as floats (torch.jit.script types attributes by value: test_deploy.py).
    assert repr(m) == ("Timesteps(num_channels=8, flip_sin_to_cos=False, downscale_freq_shift=1.0, scale=3.0, "
                       "max_period=50.0)")
    # The attributes are read at each call, as in diffusers.
    m.flip_sin_to_cos = True
    t = torch.tensor([1.0, 10.0])
    assert torch.equal(m(t), timestep_embedding(t, 8, flip_sin_to_cos=True, scale=3, max_period=50))
    with pytest.raises(TypeError):
        posenc.Timesteps(256)  # flip_sin_to_cos and downscale_freq_shift are required, as in diffusers


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_channels=0, flip_sin_to_cos=True, downscale_freq_shift=0), ValueError,
     "timestep_embedding: expected dim to be a positive int, got 0"),
    (dict(num_channels=2.5, flip_sin_to_cos=True, downscale_freq_shift=0), TypeError,
     "expected dim to be a positive int, got 2.5"),
    (dict(num_channels=2, flip_sin_to_cos=True, downscale_freq_shift=1), ValueError,
     r"half of dim \(1\) minus downscale_freq_shift \(1.0\) must not be zero"),
    (dict(num_channels=8, flip_sin_to_cos=True, downscale_freq_shift=0, scale=float("nan")), ValueError,
     "expected scale to be a finite number, got nan"),
    (dict(num_channels=8, flip_sin_to_cos=True, downscale_freq_shift=0, max_period=0), ValueError,
     "expected max_period to be a finite number > 0, got 0.0"),
    (dict(num_channels=8, flip_sin_to_cos=True, downscale_freq_shift=None), TypeError,
     "expected downscale_freq_shift to be a real number, got None"),
])
def test_bad_settings_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        posenc.Timesteps(**kwargs)


def test_bad_timesteps():
    m = posenc.Timesteps(8, True, 0)
    with pytest.raises(ValueError, match=r"expected t to be a 1-D tensor of timesteps, got \(2, 2\)"):
        m(torch.rand(2, 2))
    with pytest.raises(TypeError, match="expected t to be a Tensor, got list"):
        m([1.0, 2.0])


def test_gradient_meta_and_compile():
    m = posenc.Timesteps(16, True, 0)
    t = (torch.rand(4) * 100).requires_grad_(True)
    m(t).sum().backward()
    assert t.grad is not None and t.grad.shape == (4,)
    meta = m(torch.empty(3, device="meta"))
    assert meta.shape == (3, 16) and meta.device.type == "meta"
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.rand(6) * 1000
    assert bits_equal(compiled(x), m(x))


def test_matches_real_diffusers():
    """The peer itself, when installed (not a dependency)."""
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    t = torch.rand(9) * 1000
    for config in CONFIGS:
        kwargs = {k: v for k, v in config.items() if k != "max_period"}
        if config.get("max_period", 10000) != 10000:
            continue  # diffusers' Timesteps has no max_period
        ref = embeddings.Timesteps(**kwargs)
        assert torch.equal(posenc.Timesteps(**config)(t), ref(t))
        assert posenc.Timesteps(**config).state_dict().keys() == ref.state_dict().keys()
    # Every config (max_period too) through the function Timesteps calls, get_timestep_embedding.
    for config in CONFIGS:
        channels = config["num_channels"]
        kwargs = {k: v for k, v in config.items() if k != "num_channels"}
        assert torch.equal(timestep_embedding(t, channels, **kwargs),
                           embeddings.get_timestep_embedding(t, channels, **kwargs)), config
