"""A small U-Net Transformer (U-shaped conv net with attention at the bottom).

Markable blocks, in order (``L = len(channels) - 1`` encoder levels)::

    enc_0 ... enc_{L-1}, mid_0 ... mid_{bottleneck_depth-1}, dec_{L-1} ... dec_0

Encoder level ``i`` feeds decoder level ``i`` through a long skip connection
(channel concatenation). Because the blocks are cut into contiguous stages in
this order, with one stage per block the stage of ``enc_i`` is ``i`` and the
stage of ``dec_i`` is ``n - 1 - i``: the skips cross stage boundaries
symmetrically, as in the U-Transformer pipeline of the paper (§5.2).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from examples.gpt import SelfAttention
from examples.mlp import stage_ends
from meshpar.stage_boundary import mark_stage_boundary

__all__ = ["ConvUnit", "UTransformer", "ut_batch", "ut_loss"]


class ConvUnit(nn.Module):
    """Conv 3x3 + GroupNorm + gelu: ``[B, H, W, C_in]`` -> ``[B, H, W, features]``."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.Conv(self.features, (3, 3), strides=self.strides, padding="SAME")(x)
        # gcd keeps the group count valid for any channel width.
        x = nn.GroupNorm(num_groups=math.gcd(4, self.features))(x)
        return nn.gelu(x)


class _EncoderLevel(nn.Module):
    """Conv unit; returns (skip, output), the output halved in H and W if ``downsample``."""

    features: int
    next_features: int
    downsample: bool

    @nn.compact
    def __call__(self, x):
        skip = ConvUnit(self.features)(x)
        if not self.downsample:
            return skip, skip
        return skip, ConvUnit(self.next_features, strides=2, name="down")(skip)


class _BottleneckBlock(nn.Module):
    """Conv unit, then residual self-attention over the H*W positions. Shape-preserving."""

    features: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        x = ConvUnit(self.features)(x)
        b, h, w, c = x.shape
        tokens = x.reshape(b, h * w, c)
        tokens = tokens + SelfAttention(self.num_heads, name="attn")(nn.LayerNorm()(tokens))
        return tokens.reshape(b, h, w, c)


class _DecoderLevel(nn.Module):
    """Optional 2x nearest upsample, concat with the skip, conv unit."""

    features: int
    upsample: bool

    @nn.compact
    def __call__(self, x, skip):
        if self.upsample:
            b, h, w, c = x.shape
            x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")
        return ConvUnit(self.features)(jnp.concatenate([x, skip], axis=-1))


class UTransformer(nn.Module):
    """U-Net Transformer: images ``[B, H, W, C]`` -> predictions ``[B, H, W, C]``.

    ``channels[:-1]`` are the widths of the encoder (and mirrored decoder)
    levels; ``channels[-1]`` is the bottleneck width. Encoder levels after the
    first run at half the previous resolution, so ``H`` and ``W`` must be
    divisible by ``2 ** (len(channels) - 2)``; the bottleneck runs at the
    deepest encoder level's resolution (2x2 for 8x8 inputs with the default
    channels), where attention over all positions is cheap.

    There are ``2 * (len(channels) - 1) + bottleneck_depth`` markable blocks
    (8 with the defaults), so ``num_stages`` may be up to that count.
    """

    channels: tuple[int, ...] = (8, 16, 32, 32)
    num_stages: int = 1
    num_heads: int = 4
    bottleneck_depth: int = 2

    @property
    def num_blocks(self) -> int:
        return 2 * (len(self.channels) - 1) + self.bottleneck_depth

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        if len(self.channels) < 2:
            raise ValueError(f"channels={self.channels} needs at least two entries")
        levels = len(self.channels) - 1
        factor = 2 ** (levels - 1)
        if x.shape[1] % factor or x.shape[2] % factor:
            raise ValueError(f"H and W ({x.shape[1]}x{x.shape[2]}) must be divisible by {factor}")
        ends = stage_ends(self.num_blocks, self.num_stages)
        block = 0

        def end_block():
            nonlocal block
            if block in ends:
                mark_stage_boundary()
            block += 1

        in_channels = x.shape[-1]
        skips = []
        for i in range(levels):
            last = i == levels - 1
            next_features = self.channels[i + 1] if not last else self.channels[i]
            skip, x = _EncoderLevel(self.channels[i], next_features, not last, name=f"enc_{i}")(x)
            skips.append(skip)
            end_block()
        for j in range(self.bottleneck_depth):
            x = _BottleneckBlock(self.channels[-1], self.num_heads, name=f"mid_{j}")(x)
            end_block()
        for i in reversed(range(levels)):
            level = _DecoderLevel(self.channels[i], upsample=i < levels - 1, name=f"dec_{i}")
            x = level(x, skips[i])
            if i == 0:
                # The output projection belongs to the last block (last stage).
                x = nn.Conv(in_channels, (1, 1), name="out_proj")(x)
            end_block()
        return x


def ut_loss(pred: jnp.ndarray, target: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error (a scalar)."""
    return jnp.mean((pred - target) ** 2)


def ut_batch(seed: int, batch: int, hw: int = 8, c: int = 3) -> dict[str, np.ndarray]:
    """A denoising batch: ``{"x": float32 [B, hw, hw, c], "y": same shape}``.

    ``y`` is a smooth image (2x2-pixel blocks of random values) and ``x`` is
    ``y`` plus Gaussian noise, so the model has a real task to learn.
    """
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((batch, (hw + 1) // 2, (hw + 1) // 2, c))
    y = coarse.repeat(2, axis=1).repeat(2, axis=2)[:, :hw, :hw]
    x = y + 0.3 * rng.standard_normal(y.shape)
    return {"x": x.astype(np.float32), "y": y.astype(np.float32)}
