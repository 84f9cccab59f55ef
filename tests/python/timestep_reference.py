"""Float32 and float64 references of diffusers' get_timestep_embedding (the formula its
Timesteps module and PixArt/SD3 use), shared by test_timesteps.py and
test_sinusoidal_table.py."""

import math

import torch


def diffusers_float32(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                      max_period=10000):
    """diffusers' get_timestep_embedding, operation for operation in float32, as its
    Timesteps.forward calls it (on timesteps' device)."""
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32,
                                                    device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


def diffusers_float64(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                      max_period=10000):
    """The same formula in float64 on the CPU: the exact values the float32 embedding
    approximates, and the angles (for error bounds)."""
    half = embedding_dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / (half - downscale_freq_shift))
    angles = scale * timesteps.cpu().double()[:, None] * freqs
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], -1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], -1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb, angles
