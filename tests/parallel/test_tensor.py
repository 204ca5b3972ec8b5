"""shardkit.tensor: every TP primitive equals its unsharded twin, values and gradients.

Twins are vit_ref's layers on whole weights: ``dense`` for the column- and row-parallel
matmuls, ``self_attention`` for ``attention_tp`` (plain core), ``mlp`` for ``mlp_tp``. Each
primitive gets its own input and params (random biases, so a bias added on every shard instead
of once would show), all run in ONE ``shard_map`` per drawn case (one compile), and the loss
``sum(sin(y) · w)`` is non-linear with random weights, so every device's cotangent differs.
Gradients are taken outside ``shard_map`` with respect to the global inputs and params, which
also exercises the implicit casts at the boundary (the data-axis gradient sums).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardkit import ledger
from shardkit.mesh import make_mesh
from shardkit.parallel.tensor import (
    attention_region,
    attention_tp,
    dense_column,
    dense_row,
    enter_tp,
    exit_tp,
    join_halves,
    mlp_region,
    mlp_tp,
    pipelined_regions,
    split_halves,
)
from shardkit.testing import assert_trees_close
from vit_ref import model as ref

TOL = 1e-5
# Values, not speed, are under test: skipping LLVM's optimisations halves compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
MESHES = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3), (1, 4), (2, 4)]  # (data, model)

# Global shapes use vit_ref's alphabet: b batch, t tokens, d width, h heads, k head dim, f MLP.
COLUMN, ROW = "btd,df->btf", "btf,fd->btd"
PROJ_IN = {"kernel": P(None, "model", None), "bias": P("model", None)}
ATTN_SPECS = {
    "query": PROJ_IN,
    "key": PROJ_IN,
    "value": PROJ_IN,
    "out": {"kernel": P("model", None, None), "bias": P()},
}
MLP_SPECS = {
    "fc1": {"kernel": P(None, "model"), "bias": P("model")},
    "fc2": {"kernel": P("model", None), "bias": P()},
}
TOKENS_SPLIT = P("data", "model", None)  # x[B_data, T_model, D] (Megatron-SP)


@dataclasses.dataclass(frozen=True)
class Case:
    data: int
    model: int
    batch: int  # per data shard
    tokens: int  # per model shard (T = tokens · model, so token scatters divide)
    dim: int
    heads: int  # per model shard
    head_dim: int
    mlp: int  # per model shard
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    data, model = draw(st.sampled_from(MESHES))
    return Case(
        data=data,
        model=model,
        batch=draw(st.integers(1, 2)),
        tokens=draw(st.integers(1, 3)),
        dim=draw(st.sampled_from([3, 4, 8])),
        heads=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([1, 2, 4])),
        mlp=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


@functools.cache
def mesh_of(data: int, model: int) -> Mesh:
    return make_mesh({"data": data, "model": model})


# ----------------------------------------------------------------------------- the primitives

# name -> (sharded body on local blocks, unsharded twin, spec of x, spec of the output).
# ``x`` is the primitive's input: [B, T, D] (or [B, T, F] for the row-parallel dense).
Primitive = tuple[Any, Any, P, P]
PRIMITIVES: dict[str, Primitive] = {
    "dense_column": (
        lambda x, p, axis: dense_column(enter_tp(x, axis), p, COLUMN),
        lambda x, p: ref.dense(x, p, COLUMN, None),
        P("data"),
        P("data", None, "model"),
    ),
    "dense_row": (
        lambda h, p, axis: dense_row(h, p, ROW, axis),
        lambda h, p: ref.dense(h, p, ROW, None),
        P("data", None, "model"),
        P("data"),
    ),
    "dense_row_scatter": (
        lambda h, p, axis: dense_row(h, p, ROW, axis, token_dim=1),
        lambda h, p: ref.dense(h, p, ROW, None),
        P("data", None, "model"),
        TOKENS_SPLIT,
    ),
    "attention_tp": (
        lambda x, p, axis: attention_tp(x, p, axis, ref.attention_core),
        lambda x, p: ref.self_attention(x, p, None),
        P("data"),
        P("data"),
    ),
    "attention_tp_sp": (
        lambda x, p, axis: attention_tp(x, p, axis, ref.attention_core, token_dim=1),
        lambda x, p: ref.self_attention(x, p, None),
        TOKENS_SPLIT,
        TOKENS_SPLIT,
    ),
    "mlp_tp": (
        lambda x, p, axis: mlp_tp(x, p, axis, ref.gelu),
        lambda x, p: ref.mlp(x, p, None),
        P("data"),
        P("data"),
    ),
    "mlp_tp_sp": (
        lambda x, p, axis: mlp_tp(x, p, axis, ref.gelu, token_dim=1),
        lambda x, p: ref.mlp(x, p, None),
        TOKENS_SPLIT,
        TOKENS_SPLIT,
    ),
    # Megatron-SP's entry and exit as collective matmuls (parallel.overlap)
    "attention_tp_sp_overlap": (
        lambda x, p, axis: attention_tp(x, p, axis, ref.attention_core, token_dim=1, overlap=True),
        lambda x, p: ref.self_attention(x, p, None),
        TOKENS_SPLIT,
        TOKENS_SPLIT,
    ),
    "mlp_tp_sp_overlap": (
        lambda x, p, axis: mlp_tp(x, p, axis, ref.gelu, token_dim=1, overlap=True),
        lambda x, p: ref.mlp(x, p, None),
        TOKENS_SPLIT,
        TOKENS_SPLIT,
    ),
}


def pipelined_block(x: jax.Array, p: dict, axis: str | None) -> jax.Array:
    """Two pre-norm blocks (``tanh`` for the norm) on Domino's halves: B's MLP output crosses
    from the first block into the second unreduced."""
    attn = attention_region(p["attn"], axis, ref.attention_core, norm=jnp.tanh)
    mlp = mlp_region(p["mlp"], ref.gelu, norm=jnp.tanh)
    halves = pipelined_regions(split_halves(x), [attn, mlp], axis)
    return join_halves(pipelined_regions(halves, [attn, mlp], axis), axis)


def twin_block(x: jax.Array, p: dict) -> jax.Array:
    for _ in range(2):
        x = x + ref.self_attention(jnp.tanh(x), p["attn"], None)
        x = x + ref.mlp(jnp.tanh(x), p["mlp"], None)
    return x


# Plain TP's overlap: two half-batches a region apart (x has 2·batch rows per data shard).
PRIMITIVES["pipelined_regions"] = (pipelined_block, twin_block, P("data"), P("data"))
PARAM_SPECS = {
    "dense_column": MLP_SPECS["fc1"],
    "dense_row": MLP_SPECS["fc2"],
    "dense_row_scatter": MLP_SPECS["fc2"],
    "attention_tp": ATTN_SPECS,
    "attention_tp_sp": ATTN_SPECS,
    "mlp_tp": MLP_SPECS,
    "mlp_tp_sp": MLP_SPECS,
    "attention_tp_sp_overlap": ATTN_SPECS,
    "mlp_tp_sp_overlap": MLP_SPECS,
    "pipelined_regions": {"attn": ATTN_SPECS, "mlp": MLP_SPECS},
}


def make_inputs(case: Case) -> tuple[dict, dict]:
    """Per primitive: (x, params) with global shapes, and the loss weights of its output."""
    rng = np.random.default_rng(case.seed)
    b, t = case.batch * case.data, case.tokens * case.model
    d, h, k, f = case.dim, case.heads * case.model, case.head_dim, case.mlp * case.model

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def dense(i: int, o: int) -> dict:
        return {"kernel": normal(i, o) / math.sqrt(i), "bias": normal(o)}

    def proj_in() -> dict:
        return {"kernel": normal(d, h, k) / math.sqrt(d), "bias": normal(h, k)}

    attn = {
        "query": proj_in(),
        "key": proj_in(),
        "value": proj_in(),
        "out": {"kernel": normal(h, k, d) / math.sqrt(h * k), "bias": normal(d)},
    }
    mlp = {"fc1": dense(d, f), "fc2": dense(f, d)}
    params = {
        "dense_column": dense(d, f),
        "dense_row": dense(f, d),
        "dense_row_scatter": dense(f, d),
        "attention_tp": attn,
        "attention_tp_sp": attn,
        "mlp_tp": mlp,
        "mlp_tp_sp": mlp,
        "attention_tp_sp_overlap": attn,
        "mlp_tp_sp_overlap": mlp,
        "pipelined_regions": {"attn": attn, "mlp": mlp},
    }
    rows = {name: 2 * b if name == "pipelined_regions" else b for name in PRIMITIVES}
    inputs = {
        name: (normal(rows[name], t, f if name.startswith("dense_row") else d), params[name])
        for name in PRIMITIVES
    }
    out_width = {"dense_column": f}
    weights = {name: normal(rows[name], t, out_width.get(name, d)) for name in PRIMITIVES}
    return inputs, weights


def sharded_outputs(mesh: Mesh, axis: str | None):
    """Every primitive in one shard_map over ``mesh``: inputs -> global outputs."""
    in_specs = ({name: (PRIMITIVES[name][2], PARAM_SPECS[name]) for name in PRIMITIVES},)
    out_specs = {name: PRIMITIVES[name][3] for name in PRIMITIVES}

    def body(inputs: dict) -> dict:
        return {name: PRIMITIVES[name][0](x, p, axis) for name, (x, p) in inputs.items()}

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def unsharded_outputs(inputs: dict) -> dict:
    return {name: PRIMITIVES[name][1](x, p) for name, (x, p) in inputs.items()}


def values_and_grads(outputs_fn, inputs: dict, weights: dict) -> tuple[dict, dict]:
    """(outputs, d loss / d inputs) for loss = sum over primitives of sum(sin(y) · w)."""

    def loss(inputs: dict) -> tuple[jax.Array, dict]:
        outs = outputs_fn(inputs)
        total = sum(jnp.sum(jnp.sin(outs[name]) * weights[name]) for name in outs)
        return total, outs

    fn = jax.jit(jax.grad(loss, has_aux=True))
    grads, outs = fn.lower(inputs).compile(FAST_COMPILE)(inputs)
    return outs, grads


# ----------------------------------------------------------------------------- equivalence


@given(case=cases())
@example(case=Case(2, 4, 1, 2, 4, 1, 2, 1, seed=1))  # 8 devices, one head per shard
@example(case=Case(2, 3, 2, 1, 8, 2, 4, 2, seed=2))  # model = 3, one token per shard
def test_tp_primitives_match_unsharded_twins(case: Case) -> None:
    inputs, weights = make_inputs(case)
    mesh = mesh_of(case.data, case.model)
    got_values, got_grads = values_and_grads(sharded_outputs(mesh, "model"), inputs, weights)
    want_values, want_grads = values_and_grads(unsharded_outputs, inputs, weights)
    for name in PRIMITIVES:
        what = f"{name} for {case}"
        assert_trees_close(got_values[name], want_values[name], TOL, what=f"values of {what}")
        got, want = (split_known_zero(g[name]) for g in (got_grads, want_grads))
        assert_trees_close(got[0], want[0], TOL, what=f"grads of {what}")
        for zero, tree in ((got[1], got[0]), (want[1], want[0])):
            assert max_norm(zero) <= 1e-5 * max_norm(tree), f"key bias grad of {what}"


def max_norm(tree: Any) -> float:
    return max(float(np.linalg.norm(np.ravel(leaf))) for leaf in jax.tree.leaves(tree))


def split_known_zero(grads: tuple) -> tuple[tuple, Any]:
    """(grads with the key bias's zeroed, the key bias's) for attention; (grads, 0.0) otherwise.

    d loss / d key bias is zero analytically (softmax ignores a constant added to every logit of
    a query), so both runs hold only rounding noise there: a relative comparison of noise with
    noise is meaningless, so it is checked to be negligible instead.
    """
    d_input, d_params = grads
    if "attn" in d_params:  # the pipelined blocks' attention
        (d_input, d_attn), zero = split_known_zero((d_input, d_params["attn"]))
        return (d_input, {**d_params, "attn": d_attn}), zero
    if "key" not in d_params:
        return grads, 0.0
    key = {**d_params["key"], "bias": jnp.zeros_like(d_params["key"]["bias"])}
    return (d_input, {**d_params, "key": key}), d_params["key"]["bias"]


def test_axis_none_is_the_unsharded_layer() -> None:
    """axis=None (no TP): enter/exit are the identity and each primitive is its twin, exactly."""
    inputs, _ = make_inputs(Case(1, 1, 2, 3, 4, 2, 2, 3, seed=3))
    x = inputs["mlp_tp"][0]
    for token_dim in (None, 1):
        assert enter_tp(x, None, token_dim=token_dim) is x
        assert exit_tp(x, None, token_dim=token_dim) is x

    def without_mesh(inputs: dict) -> dict:
        return {name: PRIMITIVES[name][0](x, p, None) for name, (x, p) in inputs.items()}

    got, want = jax.jit(lambda i: (without_mesh(i), unsharded_outputs(i)))(inputs)
    for name in PRIMITIVES:
        if name == "pipelined_regions":  # the halves' matmuls round as half-batches do
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ----------------------------------------------------------------------------- enter / exit


def vma(x: jax.Array) -> frozenset[str]:
    """The mesh axes x is typed varying over."""
    return frozenset(jax.typeof(x).mat.varying)


def test_enter_and_exit_move_what_they_say() -> None:
    """enter: identity typed varying (or an all-gather of tokens); exit: psum (or psum_scatter).

    Integer-valued data: the sums are exact. Device (i, j) of data=2 × model=4 holds block
    x[i, j] (and y[i], the same on every model device); out_specs stack what each device
    returns, so every device's result is checked.
    """
    mesh = mesh_of(2, 4)
    x = np.arange(2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3)  # [data, model, T, D]
    y = -x[:, 0]  # [data, T, D]

    def stacked(z: jax.Array) -> jax.Array:  # [1, 1, ...] varying over both axes
        return (z if "model" in vma(z) else jax.lax.pcast(z, "model", to="varying"))[None, None]

    def body(x_block: jax.Array, y_block: jax.Array) -> tuple[jax.Array, ...]:
        x_block = x_block[0]  # [1, T, D], like y_block (which is invariant over model)
        entered = enter_tp(y_block, "model")
        assert "model" in vma(entered) and "model" not in vma(y_block)
        gathered = enter_tp(x_block, "model", token_dim=1)  # [1, 4·T, D]
        reduced = exit_tp(x_block, "model")
        assert "model" not in vma(reduced)
        scattered = exit_tp(x_block, "model", token_dim=1)  # [1, T/4, D]
        return tuple(stacked(z[0]) for z in (entered, gathered, reduced, scattered))

    spec = P("data", "model")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P("data")), out_specs=(spec,) * 4)
    entered, gathered, reduced, scattered = jax.jit(fn)(x, y)
    for i in range(2):
        whole = np.concatenate(list(x[i]), axis=0)  # [4·T, D]: the model blocks in order
        total = x[i].sum(axis=0)  # [T, D]
        for j in range(4):
            np.testing.assert_array_equal(entered[i, j], y[i])
            np.testing.assert_array_equal(gathered[i, j], whole)
            np.testing.assert_array_equal(reduced[i, j], total)
            np.testing.assert_array_equal(scattered[i, j], total[j : j + 1])


def test_enter_backward_all_reduces_the_cotangent() -> None:
    """d/dx sum(enter_tp(x) · w_j) over model devices j is sum_j w_j (Megatron f's psum)."""
    mesh = mesh_of(1, 4)
    w = np.arange(1.0, 13.0, dtype=np.float32).reshape(4, 3)  # one row per model device

    def loss(x: jax.Array) -> jax.Array:
        def body(x: jax.Array, w_row: jax.Array) -> jax.Array:
            return jnp.sum(enter_tp(x, "model") * w_row[0])[None]

        per_device = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("model")), out_specs=P("model")
        )
        return per_device(x, w).sum()

    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(np.ones(3, np.float32)), w.sum(0))


def test_enter_and_exit_reject_the_wrong_vma_type() -> None:
    """f needs an invariant input, g a varying partial sum: a misuse fails at trace time."""
    mesh = mesh_of(1, 2)
    varying = jax.shard_map(
        lambda x: enter_tp(x, "model"), mesh=mesh, in_specs=P("model"), out_specs=P("model")
    )
    with pytest.raises(ValueError, match="megatron_f needs an invariant value over 'model'"):
        jax.jit(varying).lower(np.zeros(4, np.float32))
    invariant = jax.shard_map(lambda x: exit_tp(x, "model"), mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match="megatron_g needs a varying partial sum over 'model'"):
        jax.jit(invariant).lower(np.zeros(4, np.float32))


def test_megatron_sp_exit_refuses_tokens_the_axis_cannot_split() -> None:
    """5 gathered tokens cannot be reduce-scattered over model=2: one sentence, at trace time."""
    mesh = mesh_of(1, 2)

    def body(x: jax.Array) -> jax.Array:
        return exit_tp(jax.lax.pcast(x, "model", to="varying"), "model", token_dim=1)

    per_device = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(None, "model"))
    with pytest.raises(ValueError, match="dim 1 has size 5, not divisible by the 2 devices") as err:
        jax.jit(per_device).lower(np.zeros((2, 5, 3), np.float32))
    assert str(err.value).count(". ") == 0


# ----------------------------------------------------------------------------- communication


def naive_attention_tp(x: jax.Array, p: dict, axis: str) -> jax.Array:
    """attention_tp without enter_tp: x stays invariant and is cast to varying once per use."""
    q, k, v = (dense_column(x, p[name], "btd,dhk->bthk") for name in ("query", "key", "value"))
    return dense_row(ref.attention_core(q, k, v), p["out"], "bthk,hkd->btd", axis)


def test_attention_tp_all_reduces_once_backward_not_three_times() -> None:
    """One f before q, k, v: their cotangents are summed locally, then ONE all-reduce.

    Bytes, not instruction counts: XLA may merge all-reduces into one tuple op. Over model,
    the forward's g and each backward reduction all-reduce one activation x[B, T, D].
    """
    case = Case(data=2, model=4, batch=1, tokens=2, dim=8, heads=1, head_dim=2, mlp=1, seed=4)
    mesh = mesh_of(case.data, case.model)
    inputs, weights = make_inputs(case)
    x, p = inputs["attention_tp"]
    w = weights["attention_tp"]
    n = case.model
    activation_bytes = case.batch * x.shape[1] * x.shape[2] * 4  # x[B_data, T, D] fp32
    unit = 2 * (n - 1) / n * activation_bytes  # one ring all-reduce of it

    def grad_fn(attention):
        body = functools.partial(attention, axis="model")
        sharded = jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), ATTN_SPECS), out_specs=P("data")
        )
        loss = lambda x, p: jnp.sum(jnp.sin(sharded(x, p)) * w)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def model_all_reduce_bytes(attention) -> float:
        found = ledger.measure(grad_fn(attention), x, p, mesh=mesh)
        return sum(c.total_bytes_sent for c in found.select("all-reduce", axes=("model",)))

    good = functools.partial(attention_tp, core=ref.attention_core)
    assert model_all_reduce_bytes(good) == pytest.approx(2 * unit)  # g forward + f backward
    assert model_all_reduce_bytes(naive_attention_tp) == pytest.approx(4 * unit)  # g + 3 casts
    value, grads = grad_fn(good)(x, p)
    naive_value, naive_grads = grad_fn(naive_attention_tp)(x, p)
    np.testing.assert_allclose(value, naive_value, rtol=1e-6)
    assert_trees_close(grads, naive_grads, TOL)
