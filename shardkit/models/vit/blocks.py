"""One layer of the sharded ViT on local blocks: the attention core a layout runs, the pre-LN
block of TP regions (``block_local``), and the same block on plain TP's two half-batches
(``block_halves``, ``Plan.halves``).

Inside ``shard_map``, per device (X = model, S = the token axes): ``x[B_data, T_S, D] ->
x + attention_tp(LN(x)) -> + mlp_tp(LN(x))``, heads and MLP hidden split over X, attention's
core over S (local, ring, Ulysses or USP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxtyping import Array

import vit_ref
from shardkit import kernels
from shardkit.parallel import sequence as sp
from shardkit.parallel import tensor
from shardkit.parallel.tensor import Halves, attention_tp, mlp_tp
from vit_ref import model as ref

if TYPE_CHECKING:  # the layout is model.py's, which imports this module
    from shardkit.models.vit.model import Layout

Params = dict[str, Any]
AttentionCore = Callable[[Array, Array, Array], Array]


def attention_core(cfg: vit_ref.ViTConfig, lay: Layout, key_valid: Array | None) -> AttentionCore:
    """The attention run on local heads: q, k, v[B, T_S, H_X, K] -> o[B, T_S, H_X, K].

    ``key_valid`` is the local attention's mask (Megatron-SP: over all tokens, built locally).
    The sequence-parallel cores mask padding by position (``num_valid``): nothing is sent.
    """
    local = lay.attention == "local"
    if local and kernels.resolve_kernel(lay.kernel, lay.padded_tokens) == "pallas":
        return lambda q, k, v: sp.attention_local(q, k, v, key_valid, kernel="pallas")[0]
    if local:  # the reference's core: the same numerics, the same speed
        mask = None if key_valid is None else key_valid[None]
        return lambda q, k, v: ref.attention_core(q, k, v, mask, ref.softmax_dtype(cfg))
    num_valid = lay.num_tokens if lay.padded else None
    cores: dict[str, Callable[..., tuple[Array, Array]]] = {
        "ring": functools.partial(sp.attention_ring, axis="seq"),
        "ulysses": functools.partial(sp.attention_ulysses, axis="seq"),
        "usp": functools.partial(
            sp.attention_usp, ulysses_axis=sp.SEQ_ULYSSES, ring_axis=sp.SEQ_RING
        ),
    }
    core = functools.partial(cores[lay.attention], num_valid=num_valid, kernel=lay.kernel)
    return lambda q, k, v: core(q, k, v, None)[0]


def block_local(
    x: Array, p: Params, key_valid: Array | None, cfg: vit_ref.ViTConfig, lay: Layout
) -> Array:
    """One pre-LN block on local tokens with heads / MLP hidden split over ``model``."""
    dtype = ref.compute_dtype(cfg)
    model = "model" if lay.mesh.shape["model"] > 1 else None
    token_dim = 1 if lay.megatron else None
    core = attention_core(cfg, lay, key_valid)
    rings = lay.overlap if lay.megatron else False
    h = ref.layer_norm(x, p["ln1"])
    a = attention_tp(h, p["attn"], model, core, dtype, token_dim=token_dim, overlap=rings)
    x = x + a.astype(x.dtype)
    h = ref.layer_norm(x, p["ln2"])
    m = mlp_tp(h, p["mlp"], model, ref.gelu, dtype, token_dim=token_dim, overlap=rings)
    return x + m.astype(x.dtype)


def block_halves(h: Halves, p: Params, cfg: vit_ref.ViTConfig, lay: Layout) -> Halves:
    """``block_local`` on two half-batches in Domino's schedule (``Plan.halves``): the
    attention and MLP regions of plain TP, each half's all-reduce beside the other's matmuls,
    B's MLP output reduced in the next block (or ``join_halves``)."""
    dtype = ref.compute_dtype(cfg)
    core = attention_core(cfg, lay, None)
    attn = tensor.attention_region(
        p["attn"], "model", core, dtype, norm=lambda x: ref.layer_norm(x, p["ln1"])
    )
    mlp = tensor.mlp_region(p["mlp"], ref.gelu, dtype, norm=lambda x: ref.layer_norm(x, p["ln2"]))
    return tensor.pipelined_regions(h, [attn, mlp], "model")
