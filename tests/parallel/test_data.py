"""shardkit.data: gradient sync, FSDP gather, ZeRO-1 and ZeRO-2 equal their unsharded twins.

Twins: the gradient of the same loss on the whole batch (``jax.grad`` outside any mesh) and one
unsharded optax AdamW step. Collectives are checked where they are made: the lowered program
(before XLA's passes) holds exactly one all-reduce per gradient bucket, and the compiled one
moves the bytes the cost model says (XLA may merge all-reduces into one tuple op, so bytes, not
instruction counts, are compared there).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardkit import data as dp
from shardkit import ledger
from shardkit.mesh import make_mesh
from shardkit.parallel.tiles import TILE_ELEMENTS, Tiles, bucket_elements
from shardkit.testing import assert_trees_close

TOL = 1e-5


@functools.cache
def mesh_of(data: int, model: int = 1) -> Mesh:
    return make_mesh({"data": data, "model": model})


def lowered_all_reduces(fn: Any, *args: Any) -> int:
    """All-reduces JAX emits for ``fn`` (StableHLO, before XLA may combine them)."""
    return len(re.findall(r"stablehlo\.all_reduce", jax.jit(fn).lower(*args).as_text()))


def bytes_sent(fn: Any, *args: Any, kind: str, mesh: Mesh) -> float:
    return sum(c.total_bytes_sent for c in ledger.measure(fn, *args, mesh=mesh).select(kind))


# ----------------------------------------------------------------------------- sync_grads

# Per leaf: global array [data, (model,) ...] of per-device summands, its in_spec, the axes
# sync_grads reduces it over, and its out_spec once reduced.
DATA, MODEL = 2, 2
SYNC_LEAVES = {
    "a": ((DATA, 4, 3), np.float32, P("data"), ("data",), P()),
    "b": ((DATA, 5), np.float32, P("data"), ("data",), P()),
    "c": ((DATA, MODEL, 2, 2), np.float32, P("data", "model"), ("data", "model"), P()),
    "d": ((DATA, MODEL, 6), np.float32, P("data", "model"), ("data",), P("model")),
    "e": ((DATA, 4), jnp.bfloat16, P("data"), ("data",), P()),
    "f": ((DATA, 3), np.float32, P("data"), (), P("data")),
}
# Buckets (axes, varying, dtype): {a, b}; {c}; {d} (split over model: never mixed with a, b);
# {e} (bf16); f is not reduced.
BUCKETS = 4


def sync_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)  # small integers: every sum is exact, in bf16 too
    return {
        name: rng.integers(-8, 8, shape).astype(dtype)
        for name, (shape, dtype, *_) in SYNC_LEAVES.items()
    }


def sync_fn():
    axes = {name: leaf[3] for name, leaf in SYNC_LEAVES.items()}

    def body(blocks: dict) -> dict:
        # Drop the device dims: each device now holds one summand of each gradient leaf.
        grads = {n: b[0, 0] if n in ("c", "d") else b[0] for n, b in blocks.items()}
        out = dp.sync_grads(grads, axes)
        return {**out, "d": out["d"][None], "f": out["f"][None]}

    in_specs = ({n: leaf[2] for n, leaf in SYNC_LEAVES.items()},)
    out_specs = {n: leaf[4] for n, leaf in SYNC_LEAVES.items()}
    return jax.shard_map(body, mesh=mesh_of(DATA, MODEL), in_specs=in_specs, out_specs=out_specs)


def test_sync_grads_sums_each_leaf_over_its_axes() -> None:
    grads = sync_inputs()
    out = jax.jit(sync_fn())(grads)
    for name in "abe":
        np.testing.assert_array_equal(out[name], grads[name].sum(0), err_msg=name)
    np.testing.assert_array_equal(out["c"], grads["c"].sum((0, 1)))
    np.testing.assert_array_equal(out["d"], grads["d"].sum(0))  # [model, 6]: per model shard
    np.testing.assert_array_equal(out["f"], grads["f"])
    assert out["e"].dtype == jnp.bfloat16


def test_sync_grads_one_all_reduce_per_bucket() -> None:
    """4 buckets, 4 all-reduces as JAX emits them; XLA may then merge those over the same
    devices into one tuple all-reduce, so the compiled program is held to the bytes."""
    grads = sync_inputs()
    assert lowered_all_reduces(sync_fn(), grads) == BUCKETS

    def ring_bytes(names: str, n: int) -> float:
        # Per device: the block without its device dims. XLA's CPU backend all-reduces bf16 in
        # f32, so "e" moves 4 bytes per element.
        local = {k: grads[k][0].size // (MODEL if k in "cd" else 1) for k in names}
        return 2 * (n - 1) / n * 4 * sum(local.values())

    expected = ring_bytes("abde", DATA) + ring_bytes("c", DATA * MODEL)
    sent = bytes_sent(sync_fn(), grads, kind="all-reduce", mesh=mesh_of(DATA, MODEL))
    assert sent == pytest.approx(expected)


# ----------------------------------------------------------------------------- vary + sync


def linear_loss(params: dict, x: jax.Array, batch: int) -> jax.Array:
    """A non-linear loss of a tiny model; ``batch`` is the GLOBAL batch size."""
    h = jnp.tanh(x @ params["kernel"] + params["bias"][None])
    return jnp.sum(jnp.sin(h) * params["scale"][None]) / batch


def dp_grads(use_vary: bool):
    """DP gradients on data=4: batch split, params replicated, explicit (or implicit) sums."""
    mesh = mesh_of(4)
    axes = {"kernel": ("data",), "bias": ("data",), "scale": ("data",)}

    def body(params: dict, x_block: jax.Array) -> dict:
        batch = x_block.shape[0] * 4
        if not use_vary:  # invariant params: check_vma's casts transpose into one psum per leaf
            return jax.grad(linear_loss)(params, x_block, batch)
        grads = jax.grad(linear_loss)(dp.vary(params, axes), x_block, batch)
        assert all(dp.varying_axes(g) == {"data"} for g in jax.tree.leaves(grads))  # {U_data}
        return dp.sync_grads(grads, axes)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())


def linear_inputs() -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(1)
    params = {
        "kernel": rng.standard_normal((5, 3)).astype(np.float32),
        "bias": rng.standard_normal(3).astype(np.float32),
        "scale": rng.standard_normal(3).astype(np.float32),
    }
    return params, rng.standard_normal((8, 5)).astype(np.float32)


def test_vary_then_sync_grads_equals_the_whole_batch_gradient() -> None:
    params, x = linear_inputs()
    want = jax.grad(linear_loss)(params, x, x.shape[0])
    for use_vary in (True, False):
        assert_trees_close(jax.jit(dp_grads(use_vary))(params, x), want, TOL)
    # vary makes the gradient sum explicit and bucketed: one all-reduce instead of one per leaf.
    assert lowered_all_reduces(dp_grads(True), params, x) == 1
    assert lowered_all_reduces(dp_grads(False), params, x) == len(params)


def test_forgetting_vary_raises_instead_of_multiplying_by_n() -> None:
    """The silent mistake: without ``vary`` autodiff already summed over data, and a second sum
    would make the gradients 4x too large. sync_grads refuses, naming the leaf and the fix."""
    params, x = linear_inputs()
    axes = {"kernel": ("data",), "bias": ("data",), "scale": ("data",)}

    def body(params: dict, x_block: jax.Array) -> dict:
        grads = jax.grad(linear_loss)(params, x_block, 8)  # no dp.vary: invariant over data
        return dp.sync_grads(grads, axes)

    fn = jax.shard_map(body, mesh=mesh_of(4), in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match=re.escape(
        "sync_grads: gradient leaf ['bias'] is already summed over 'data' (typed invariant "
        "there), so all-reducing it again would multiply it by 4; did you forget "
        "data.vary(params, axes) before the loss?"
    )):  # fmt: skip
        jax.jit(fn)(params, x)


def test_make_mesh_says_how_to_get_more_cpu_devices() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "needs 16 devices but only 8 are available; call shardkit.set_cpu_devices(16) before "
        "any other JAX call for more CPU devices."
    )):  # fmt: skip
        make_mesh({"data": 16})


def test_vary_is_an_identity_cast() -> None:
    mesh = mesh_of(2, 2)
    x = np.arange(6.0, dtype=np.float32)

    def body(x: jax.Array) -> jax.Array:
        tree = dp.vary({"a": x, "b": x}, {"a": ("data", "model"), "b": ()})
        assert dp.varying_axes(tree["a"]) == {"data", "model"} and not dp.varying_axes(tree["b"])
        return tree["a"][None, None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data", "model")))(x)
    np.testing.assert_array_equal(out, np.broadcast_to(x, (2, 2, 6)))


# ----------------------------------------------------------------------------- FSDP

FSDP_N = 4
FSDP_DIMS = {"kernel": 0, "scale": None, "bias": 0}  # kernel [D_data, F], bias [F_data]
FSDP_SPECS = {"kernel": P("data"), "scale": P(), "bias": P("data")}


def fsdp_inputs() -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(2)
    params = {
        "kernel": rng.standard_normal((8, 4)).astype(np.float32),
        "bias": rng.standard_normal(4).astype(np.float32),
        "scale": rng.standard_normal(4).astype(np.float32),
    }
    return params, rng.standard_normal((8, 8)).astype(np.float32)


def fsdp_loss(params_split: dict, x: jax.Array) -> jax.Array:
    """Batch and params split over data; the weights are gathered just before use."""

    def body(p_frag: dict, x_block: jax.Array) -> jax.Array:
        p = dp.fsdp_gather(p_frag, FSDP_DIMS)
        return linear_loss(p, x_block, x.shape[0])[None]

    mesh = mesh_of(FSDP_N)
    per_device = jax.shard_map(
        body, mesh=mesh, in_specs=(FSDP_SPECS, P("data")), out_specs=P("data")
    )
    return per_device(params_split, x).sum()


def test_fsdp_gather_materialises_the_whole_weights() -> None:
    params, _ = fsdp_inputs()

    def body(p_frag: dict) -> dict:
        assert p_frag["kernel"].shape == (8 // FSDP_N, 4)  # w[D_data, F]
        p = dp.fsdp_gather(p_frag, FSDP_DIMS)
        assert dp.varying_axes(p["kernel"]) == {"data"}  # all_gather keeps the type varying
        p["scale"] = jax.lax.pcast(p["scale"], "data", to="varying")  # not split: invariant
        return jax.tree.map(lambda w: w[None], p)

    fn = jax.shard_map(body, mesh=mesh_of(FSDP_N), in_specs=(FSDP_SPECS,), out_specs=P("data"))
    for name, gathered in jax.jit(fn)(params).items():
        np.testing.assert_array_equal(gathered, np.broadcast_to(params[name], gathered.shape))


def test_fsdp_gradient_is_the_whole_gradient_reduce_scattered() -> None:
    params, x = fsdp_inputs()
    mesh = mesh_of(FSDP_N)
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), FSDP_SPECS))
    grad_fn = jax.jit(jax.grad(fsdp_loss))
    grads = grad_fn(placed, x)
    assert_trees_close(grads, jax.grad(linear_loss)(params, x, x.shape[0]), TOL)
    for name in ("kernel", "bias"):  # arrive split: dw[D_data]
        assert grads[name].sharding.spec == P("data")
        shapes = {s.data.shape for s in grads[name].addressable_shards}
        assert shapes == {(params[name].shape[0] // FSDP_N, *params[name].shape[1:])}
    # The transpose of the all-gather: a reduce-scatter of each split gradient, no all-reduce.
    split_bytes = params["kernel"].nbytes + params["bias"].nbytes
    rs = bytes_sent(grad_fn, placed, x, kind="reduce-scatter", mesh=mesh)
    assert rs == pytest.approx((FSDP_N - 1) / FSDP_N * split_bytes)
    ar = ledger.measure(grad_fn, placed, x, mesh=mesh).select("all-reduce")
    assert sum(c.result_bytes for c in ar) <= params["scale"].nbytes + 4  # scale's grad (+ loss)


def test_bucket_elements_are_whole_tiles_the_fewest_off_a_tpu() -> None:
    """Off a TPU (or on paper) a tiled bucket takes the fewest [16, 128] tiles; the row
    counts a TPU slice keeps are probed (``tests/run/test_target.py``)."""
    for tiles in (Tiles(), Tiles(mesh_of(4))):
        assert bucket_elements(100, tiles) == TILE_ELEMENTS  # the smallest: one tile
        assert bucket_elements(TILE_ELEMENTS + 1, tiles) == 2 * TILE_ELEMENTS
        assert bucket_elements(110_664, tiles) == 110_592 + 2048  # [r, 128], r = 16·k
    assert bucket_elements(110_664) == 110_664


def test_tiled_fsdp_buckets_equal_flat_ones() -> None:
    """``tiled`` (a TPU mesh's layout) changes how a bucket travels, not what arrives: values
    and gradients identical to the flat bucket, the padding's bytes on the wire."""
    rng = np.random.default_rng(6)
    shapes = {"a": (4 * 20_000,), "b": (4 * 200, 70)}  # 34,000 elements per device: tiled
    params = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    dims, specs = {"a": 0, "b": 0}, {"a": P("data"), "b": P("data")}
    mesh = mesh_of(4)
    placed = jax.device_put(params, jax.tree.map(lambda sp: jax.NamedSharding(mesh, sp), specs))

    def loss(tiled: bool):
        def body(p):
            g = dp.fsdp_gather(p, dims, tiles=Tiles(mesh) if tiled else None)
            return (jnp.sum(jnp.sin(g["a"])) + jnp.sum(jnp.cos(g["b"]) ** 2))[None]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P("data"))
        return jax.jit(jax.value_and_grad(lambda p: fn(p).sum() / 4))

    (flat_loss, flat_grads), (tiled_loss, tiled_grads) = (loss(t)(placed) for t in (False, True))
    assert flat_loss == tiled_loss
    for k in params:
        np.testing.assert_array_equal(flat_grads[k], tiled_grads[k])
    sent = ledger.measure(loss(True), placed, mesh=mesh).select("all-gather")
    assert bucket_elements(34_000, Tiles()) == 34_816 > 34_000
    assert [c.result_bytes for c in sent] == [4 * 34_816 * 4]  # n · padded · float32


def test_tiled_zero_buckets_equal_flat_ones() -> None:
    """ZeRO-1's step with ``tiled`` buckets (a TPU mesh's layout): the reduce-scatter's rows
    and the all-gather's slices travel as padded [r, 128] tiles, and the updated params and
    optimizer state are identical to the flat buckets'."""
    rng = np.random.default_rng(7)
    shapes = {"a": (4 * 20_000,), "b": (4 * 200, 70), "bias": (3,)}
    params = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    grads = {k: rng.standard_normal((4, *v)).astype(np.float32) for k, v in shapes.items()}
    dims = {"a": 0, "b": 0, "bias": None}
    optimizer = optax.adamw(1e-2)
    mesh = mesh_of(4)
    state_specs = zero1_specs(optimizer, params, dims)
    state = jax.device_put(
        optimizer.init(params), jax.tree.map(lambda s: jax.NamedSharding(mesh, s), state_specs)
    )

    def step(tiled: bool):
        def body(p, g, st):
            g = jax.tree.map(lambda x: x[0], g)  # this device's partial gradient, dw{U_data}
            return dp.zero1_update(optimizer, g, st, p, dims, tiles=Tiles(mesh) if tiled else None)

        g_specs = jax.tree.map(lambda _: P("data"), grads)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), g_specs, state_specs),
                           out_specs=(P(), state_specs))  # fmt: skip
        return jax.jit(fn)

    flat, tiled = (step(t)(params, grads, state) for t in (False, True))
    for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(tiled), strict=True):
        np.testing.assert_array_equal(a, b)
    sent = ledger.measure(step(True), params, grads, state, mesh=mesh)
    assert bucket_elements(34_000, Tiles()) == 34_816
    assert [c.result_bytes for c in sent.select("reduce-scatter")] == [34_816 * 4]
    assert [c.result_bytes for c in sent.select("all-gather")] == [4 * 34_816 * 4]


def test_fsdp_buckets_gather_each_group_of_leaves_in_one_op() -> None:
    """Four split leaves (split dims 0 and 1; two also split over model) on data=4 × model=2:
    bucketed, one all-gather per group of equal varying axes (2) and one reduce-scatter per
    group in backward, where leaf by leaf takes 4 of each; values and gradients identical."""
    rng = np.random.default_rng(5)
    shapes = {"a": (8, 6), "b": (4, 8), "c": (8, 4), "d": (4, 8, 2)}
    dims = {"a": 0, "b": 1, "c": 0, "d": 1}
    specs = {"a": P("data"), "b": P(None, "data"), "c": P("data", "model"),
             "d": P("model", "data")}  # fmt: skip
    params = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    mesh = mesh_of(4, 2)
    placed = jax.device_put(params, jax.tree.map(lambda sp: jax.NamedSharding(mesh, sp), specs))
    whole = {"a": P(), "b": P(), "c": P(None, "model"), "d": P("model")}

    def gathered(bucket: bool):
        def body(p):
            return dp.fsdp_gather(p, dims, bucket=bucket)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=whole,
                                     check_vma=False))  # fmt: skip

    def loss(bucket: bool):
        def body(p):
            g = dp.fsdp_gather(p, dims, bucket=bucket)
            return sum(jnp.sum(jnp.sin(v) * (i + 1)) for i, v in enumerate(g.values()))[None]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P(("data", "model")))
        return jax.jit(jax.grad(lambda p: fn(p).sum() / 8))

    for bucket in (True, False):
        out = gathered(bucket)(placed)
        for k in params:
            np.testing.assert_array_equal(out[k], params[k])
    grads = {bucket: loss(bucket)(placed) for bucket in (True, False)}
    for k in params:
        np.testing.assert_array_equal(grads[True][k], grads[False][k])
    for bucket, ops in ((True, 2), (False, 4)):
        led = ledger.measure(loss(bucket), placed, mesh=mesh).summary()
        assert led[("all-gather", ("data",))].count == ops
        assert led[("reduce-scatter", ("data",))].count == ops


# ----------------------------------------------------------------------------- ZeRO-1

ZERO_N = 4
ZERO_DIMS = {"kernel": 0, "scale": None, "bias": 0}


# Every split leaf on dim 0 would let a reduce-scatter that ignores the split dim pass: the
# second case splits the kernel [D, F] along F (dim 1).
ZERO_DIMS_CASES = [ZERO_DIMS, {"kernel": 1, "scale": None, "bias": 0}]


def split_spec(dim: int | None) -> P:
    """The spec of a leaf split over data along ``dim`` (None: replicated)."""
    return P() if dim is None else P(*([None] * dim), "data")


def zero1_specs(optimizer: optax.GradientTransformation, params: dict, dims: dict) -> Any:
    """Optimizer-state specs: param-shaped leaves split like ``dims``, the rest replicated."""
    return optax.tree_map_params(
        optimizer,
        lambda _, dim: split_spec(dim),
        optimizer.init(params),
        dims,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: x is None,
    )


@pytest.mark.parametrize("zero_dims", ZERO_DIMS_CASES, ids=lambda d: f"kernel-dim{d['kernel']}")
def test_zero1_step_equals_the_unsharded_adamw_step(zero_dims: dict) -> None:
    """One ZeRO-1 AdamW step: reduce-scatter the gradient, update a 1/n slice, all-gather."""
    params, x = fsdp_inputs()
    optimizer = optax.adamw(1e-2, weight_decay=1e-2)
    mesh = mesh_of(ZERO_N)
    state_specs = zero1_specs(optimizer, params, zero_dims)
    batch = x.shape[0]

    def body(params: dict, state_frag: Any, x_block: jax.Array) -> tuple[dict, Any]:
        axes = {name: ("data",) for name in params}
        grads = jax.grad(linear_loss)(dp.vary(params, axes), x_block, batch)  # dw{U_data}
        return dp.zero1_update(optimizer, grads, state_frag, params, zero_dims)

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), state_specs, P("data")),
            out_specs=(P(), state_specs),
        )
    )
    state = jax.device_put(
        optimizer.init(params), jax.tree.map(lambda s: jax.NamedSharding(mesh, s), state_specs)
    )
    new_params, new_state = step(params, state, x)

    want_state = optimizer.init(params)
    grads = jax.grad(linear_loss)(params, x, batch)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        updates, want_state = optimizer.update(grads, want_state, params)
        want_params = optax.apply_updates(params, updates)
    assert_trees_close(new_params, want_params, TOL)
    assert_trees_close(new_state, want_state, TOL)
    adam = new_state[0]
    for name, dim in zero_dims.items():  # each device holds 1/n of the split moments
        for moment in (adam.mu[name], adam.nu[name]):
            shapes = {s.data.shape for s in moment.addressable_shards}
            split = list(params[name].shape)
            if dim is not None:
                split[dim] //= ZERO_N
            assert shapes == {tuple(split)}, name
    # Same bytes as one all-reduce of the split leaves: a reduce-scatter plus an all-gather.
    split_bytes = params["kernel"].nbytes + params["bias"].nbytes
    one_way = (ZERO_N - 1) / ZERO_N * split_bytes
    for kind in ("reduce-scatter", "all-gather"):
        assert bytes_sent(step, params, state, x, kind=kind, mesh=mesh) == pytest.approx(one_way)


SCATTER_SHAPES = {"a": (8, 4), "b": (3, 8, 4), "c": (4, 2, 8), "d": (5,)}


@pytest.mark.parametrize(
    "dims",
    [
        {"a": 0, "b": 1, "c": 2, "d": None},
        {"a": 1, "b": 2, "c": 0, "d": None},
        {"a": 1, "b": None, "c": 2, "d": None},
    ],
    ids=str,
)
@pytest.mark.parametrize("permuted", [False, True], ids=["reduce-scatter", "permutes"])
def test_zero_scatter_sums_each_leaf_and_splits_it_along_its_own_dim(
    dims: dict, permuted: bool
) -> None:
    """Device k keeps block k along each leaf's split dim of the sum over devices (leaves
    split along dims 1 and 2 included); unsplit leaves come back as the device's own value.
    ``permuted`` (overlap's form, recursive halving's exchanges): the same result."""
    rng = np.random.default_rng(3)  # small integers: every sum is exact
    per_device = {
        k: rng.integers(-8, 8, (ZERO_N, *shape)).astype(np.float32)
        for k, shape in SCATTER_SHAPES.items()
    }

    def body(blocks: dict) -> dict:
        grads = {k: b[0] for k, b in blocks.items()}  # this device's summand
        out = dp.zero_scatter(grads, dims, permuted=permuted)
        return {k: v if dims[k] is not None else v[None] for k, v in out.items()}

    out_specs = {k: split_spec(d) if d is not None else P("data") for k, d in dims.items()}
    fn = jax.shard_map(body, mesh=mesh_of(ZERO_N), in_specs=(P("data"),), out_specs=out_specs)
    got = jax.jit(fn)(per_device)
    for k, d in dims.items():
        want = per_device[k] if d is None else per_device[k].sum(axis=0)
        np.testing.assert_array_equal(got[k], want, err_msg=k)


ZERO2_LAYERS = {  # two stacked layers of h -> tanh(h @ kernel + bias) * scale
    "kernel": np.stack([np.eye(8, dtype=np.float32) * 0.5, np.full((8, 8), 0.125, np.float32)]),
    "bias": np.stack([np.linspace(-1, 1, 8, dtype=np.float32)] * 2),
    "scale": np.stack([np.linspace(1, 2, 8, dtype=np.float32)] * 2),
}
ZERO2_DIMS = {"kernel": 0, "bias": 0, "scale": None}  # per layer: kernel [D_data, F], bias [F_data]


def layer_stack_loss(x: jax.Array, layers: dict, attach: Any, batch: int) -> jax.Array:
    """``attach(layer)`` -> the params the layer uses (identity for the reference)."""

    def step(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        p = attach(layer)
        return jnp.tanh(h @ p["kernel"] + p["bias"][None]) * p["scale"][None], None

    h, _ = jax.lax.scan(step, x, layers)
    return jnp.sum(jnp.sin(h)) / batch


def test_zero2_gradient_arrives_reduce_scattered_inside_a_scan() -> None:
    """ZeRO-2's hook in a two-layer scan: the gradient w.r.t. the fragments is this device's
    slice of the whole-batch gradient (split leaves) or this device's partial sum (``scale``,
    kept whole); one reduce-scatter per layer in backward and no all-reduce over data."""
    _, x = fsdp_inputs()
    mesh = mesh_of(ZERO_N)
    batch = x.shape[0]

    def frag_loss(frags: dict, full: dict, x_block: jax.Array) -> jax.Array:
        full = dp.vary(full, {name: ("data",) for name in full})  # cotangents arrive unreduced
        attach = lambda pair: dp.zero_attach(*pair, ZERO2_DIMS)  # noqa: E731
        return layer_stack_loss(x_block, (full, frags), attach, batch)

    def body(frags: dict, full: dict, x_block: jax.Array) -> dict:
        # scale is kept whole: cast varying so its gradient stays this device's partial sum.
        frags = dp.vary(frags, {"kernel": (), "bias": (), "scale": ("data",)})
        return jax.grad(frag_loss)(frags, full, x_block)

    frag_specs = {"kernel": P(None, "data"), "bias": P(None, "data"), "scale": P()}
    grad_specs = {**frag_specs, "scale": P("data")}  # scale's partial sums, stacked over data
    grad_fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(frag_specs, P(), P("data")),
                      out_specs=grad_specs)
    )  # fmt: skip
    frags = jax.device_put(
        ZERO2_LAYERS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), frag_specs)
    )
    got = grad_fn(frags, ZERO2_LAYERS, x)
    want = jax.grad(lambda p: layer_stack_loss(x, p, lambda layer: layer, batch))(ZERO2_LAYERS)
    for name in ("kernel", "bias"):
        assert got[name].sharding.spec == P(None, "data")
        np.testing.assert_allclose(got[name], want[name], rtol=TOL, atol=1e-7)
    np.testing.assert_allclose(got["scale"].reshape(ZERO_N, 2, 8).sum(0), want["scale"], 1e-5)
    led = ledger.measure(grad_fn, frags, ZERO2_LAYERS, x, mesh=mesh).summary()
    rs = led[("reduce-scatter", ("data",))]
    assert rs.count == 2  # one bucket per layer, made in that layer's backward step
    split_bytes = ZERO2_LAYERS["kernel"].nbytes + ZERO2_LAYERS["bias"].nbytes
    assert rs.bytes_sent == pytest.approx((ZERO_N - 1) / ZERO_N * split_bytes)
    assert ("all-reduce", ("data",)) not in led


def test_zero2_overlapped_scatters_run_one_layer_behind_as_permutes() -> None:
    """ZeRO-2 with ``overlap``: ``zero_attach(permuted=True)`` as ``prefetch_layers``' fetch
    over (params, fragments). The fragments' gradient equals the plain hook's, and each
    layer's reduce-scatter is log2(n) exchanges (n = 4: 2 per layer, 4 in all) with no
    reduce-scatter or all-reduce left, the same bytes."""
    _, x = fsdp_inputs()
    mesh = mesh_of(ZERO_N)
    batch = x.shape[0]

    def grads(prefetch: bool) -> Any:
        def loss(frags: dict, full: dict, x_block: jax.Array) -> jax.Array:
            full = dp.vary(full, {name: ("data",) for name in full})
            if not prefetch:
                attach = lambda pair: dp.zero_attach(*pair, ZERO2_DIMS)  # noqa: E731
                return layer_stack_loss(x_block, (full, frags), attach, batch)
            fetch = lambda pair: dp.zero_attach(*pair, ZERO2_DIMS, permuted=True)  # noqa: E731
            layer = lambda h, p: jnp.tanh(h @ p["kernel"] + p["bias"][None]) * p["scale"][None]  # noqa: E731
            h = dp.prefetch_layers(layer, fetch, x_block, (full, frags))
            return jnp.sum(jnp.sin(h)) / batch

        def body(frags: dict, full: dict, x_block: jax.Array) -> dict:
            frags = dp.vary(frags, {"kernel": (), "bias": (), "scale": ("data",)})
            return jax.grad(loss)(frags, full, x_block)

        specs = {"kernel": P(None, "data"), "bias": P(None, "data"), "scale": P()}
        out = {**specs, "scale": P("data")}
        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P("data")), out_specs=out)
        )
        frags = jax.device_put(
            ZERO2_LAYERS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs)
        )
        return fn(frags, ZERO2_LAYERS, x), ledger.measure(fn, frags, ZERO2_LAYERS, x, mesh=mesh)

    (plain, plain_led), (overlapped, led) = grads(False), grads(True)
    for name in ZERO2_LAYERS:
        np.testing.assert_allclose(overlapped[name], plain[name], rtol=TOL, atol=1e-7)
    summary = led.summary()
    assert summary[("collective-permute", ("data",))].count == 4
    assert ("reduce-scatter", ("data",)) not in summary and ("all-reduce", ("data",)) not in summary
    assert led.total_bytes_sent() == pytest.approx(plain_led.total_bytes_sent())
