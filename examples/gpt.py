"""A small GPT-style decoder split into pipeline stages.

Tensor-parallel layout (Megatron style) via ``nn.with_partitioning`` on the
mesh axis ``"model"``: the qkv and MLP-up kernels are split by output column,
the attention-output and MLP-down kernels by input row, so each block needs
one reduction per sub-layer. Everything else is left unannotated.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from examples.mlp import stage_ends
from meshpar.stage_boundary import mark_stage_boundary

__all__ = ["GPT", "GPTBlock", "SelfAttention", "gpt_batch", "gpt_loss"]

_default_kernel_init = nn.initializers.lecun_normal()


def _dense(features: int, names: tuple[str | None, str | None], name: str, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(
        features, kernel_init=nn.with_partitioning(_default_kernel_init, names), name=name, use_bias=use_bias
    )


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    Input ``[B, N, D]`` -> output ``[B, N, D]``; ``D`` must be divisible by
    ``num_heads``. With ``causal=True`` position ``t`` attends only to
    positions ``<= t``.
    """

    num_heads: int
    causal: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        b, n, d = x.shape
        if d % self.num_heads:
            raise ValueError(f"feature size {d} is not divisible by num_heads={self.num_heads}")
        head_dim = d // self.num_heads
        # No bias: a key bias shifts every score of a query equally, so softmax
        # ignores it and its gradient is exactly zero, which Adam would turn
        # into updates driven by rounding noise.
        qkv = _dense(3 * d, (None, "model"), "qkv", use_bias=False)(x)
        # Head-major column order [head, (q, k, v), head_dim]: a contiguous
        # column shard of the kernel then holds whole heads, so tensor
        # parallelism over "model" needs no communication inside attention.
        qkv = qkv.reshape(b, n, self.num_heads, 3, head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * head_dim**-0.5
        if self.causal:
            mask = jnp.tril(jnp.ones((n, n), dtype=bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d)
        return _dense(d, ("model", None), "out")(out)


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal attention, then a 4x MLP.

    Input ``[B, T, D]`` -> output ``[B, T, D]``.
    """

    num_heads: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        d = x.shape[-1]
        attn = SelfAttention(self.num_heads, causal=True, name="attn")
        x = x + attn(nn.LayerNorm(name="ln_1")(x))
        h = nn.LayerNorm(name="ln_2")(x)
        h = nn.gelu(_dense(4 * d, (None, "model"), "mlp_up")(h))
        return x + _dense(d, ("model", None), "mlp_down")(h)


class _ScanBody(nn.Module):
    """One ``GPTBlock`` as an ``nn.scan`` body: carry in, carry out, nothing stacked out."""

    num_heads: int
    remat: bool

    @nn.compact
    def __call__(self, x: jnp.ndarray, _: None) -> tuple[jnp.ndarray, None]:
        block = nn.remat(GPTBlock) if self.remat else GPTBlock
        return block(self.num_heads, name="block")(x), None


class _ScannedBlocks(nn.Module):
    """``num_layers`` blocks stacked in one ``nn.scan``: each parameter leaf ``[num_layers, ...]``."""

    num_heads: int
    num_layers: int
    remat: bool

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        scan = nn.scan(_ScanBody, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.num_layers,
                       metadata_params={nn.PARTITION_NAME: None})
        x, _ = scan(self.num_heads, self.remat, name="stack")(x, None)
        return x


class GPT(nn.Module):
    """GPT-style decoder: int32 tokens ``[B, T]`` -> float32 logits ``[B, T, vocab_size]``.

    ``T`` may be at most ``seq_len``. The ``num_layers`` blocks are the
    markable units: the token/position embeddings run in the first stage, the
    final LayerNorm and the output projection in the last. With
    ``tie_embeddings`` the output projection is the token embedding's
    transpose (GPT-2's tied embeddings): one parameter read by the first and
    the last stage, which sit on different meshes. With ``scan_layers`` the
    blocks are one ``nn.scan`` (parameters stacked ``[num_layers, ...]`` under
    ``blocks/stack``, as large-model codebases write them; ``remat_blocks``
    puts ``nn.remat`` inside the scanned body) and the model calls no marker:
    meshpar cuts the scan itself (``num_stages``, ``auto_layers``, planning).
    """

    vocab_size: int = 64
    seq_len: int = 8
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 8
    num_stages: int = 1
    tie_embeddings: bool = False
    scan_layers: bool = False
    remat_blocks: bool = False

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        ends = stage_ends(self.num_layers, self.num_stages)
        t = tokens.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.seq_len}")
        tok_embed = nn.Embed(self.vocab_size, self.d_model, name="tok_embed")
        x = tok_embed(tokens)
        x = x + nn.Embed(self.seq_len, self.d_model, name="pos_embed")(jnp.arange(t))
        if self.scan_layers:
            x = _ScannedBlocks(self.num_heads, self.num_layers, self.remat_blocks, name="blocks")(x)
        for i in range(0 if self.scan_layers else self.num_layers):
            x = GPTBlock(self.num_heads, name=f"block_{i}")(x)
            if i in ends:
                mark_stage_boundary()
        x = nn.LayerNorm(name="ln_f")(x)
        if self.tie_embeddings:
            return tok_embed.attend(x)
        return nn.Dense(self.vocab_size, name="head")(x)


def gpt_loss(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean softmax cross-entropy over all tokens: ``[B, T, V]``, ``[B, T]`` -> scalar."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def gpt_batch(rng_seed: int, batch_size: int, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
    """A next-token batch: ``{"x": int32 [B, T], "y": int32 [B, T]}``, ``y[:, t] = x[:, t+1]``.

    Each row is an arithmetic progression mod ``vocab`` with a random start
    and stride, so the next token is predictable from the previous two and a
    training run has something to learn.
    """
    rng = np.random.default_rng(rng_seed)
    start = rng.integers(0, vocab, size=(batch_size, 1))
    stride = rng.integers(1, vocab, size=(batch_size, 1))
    seq = (start + stride * np.arange(seq_len + 1)) % vocab
    return {"x": seq[:, :-1].astype(np.int32), "y": seq[:, 1:].astype(np.int32)}
