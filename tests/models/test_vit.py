"""shardkit.vit: the sharded ViT equals vit_ref on every plan (logits, every gradient, one step).

Twin: vit_ref's forward, ``jax.grad(loss_fn)`` and one optax update (``verify_optimizer``) on the
same params and batch, compared leaf by leaf with ``assert_trees_close`` (1e-5 relative L2 in
fp32). Params are drawn non-degenerate: a random head, and biases, LayerNorm parameters, class
token and position embedding away from their 0 / 1 inits, so a bias or scale applied in the
wrong place (once per shard, or not at all) changes the logits.

Compile time dominates on CPU: per drawn case the reference and the sharded model are each ONE
program (logits, gradients and the AdamW update together), models are cached per (cfg, plan),
and XLA's backend optimisations are off for this module (values, not speed, are under test).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import example, given

import vit_ref
from shardkit.comm import ledger
from shardkit.mesh import Plan, PlanError
from shardkit.models.vit import ShardedViT, check_plan, cost, cost_params, report
from shardkit.models.vit.strategies import sharded_cases
from shardkit.run import verify
from shardkit.testing import assert_trees_close, max_error
from vit_ref.train import apply_optimizer

TOL = verify.TOLERANCE["float32"]
Case = tuple[vit_ref.ViTConfig, Plan, int]


@pytest.fixture(autouse=True, scope="module")
def fast_compile() -> Iterator[None]:
    """Skips XLA's backend optimisations while this module runs: compiles take half the time.

    Afterwards the cached models are dropped: every loaded CPU executable holds ~400 memory
    mappings until it is freed, and a process may have 65530 (vm.max_map_count), beyond which
    XLA segfaults (seen with the thorough profile before the model cache was bounded).
    """
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    _model.cache_clear()
    compiled_train_step.cache_clear()
    gc.collect()


def vit(**overrides: Any) -> vit_ref.ViTConfig:
    base = dict(image=8, patch=4, channels=3, classes=5, dim=16, depth=2, heads=2, mlp_dim=16)
    return vit_ref.ViTConfig(**{**base, "head_zeroinit": False, **overrides})


# ----------------------------------------------------------------------------- twins


def params_for(cfg: vit_ref.ViTConfig, seed: int = 0) -> dict:
    """Random params shaped like ``vit_ref.init``'s, none degenerate (drawn with NumPy: no compile).

    Kernels ~ N(0, 1/fan_in) like the init's; every other leaf (biases, LayerNorm, class token,
    position embedding) is its init value (0, or 1 for scales) plus N(0, 0.1²) noise.
    """
    shapes = jax.eval_shape(functools.partial(vit_ref.init, cfg=cfg), jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: jax.ShapeDtypeStruct, names: tuple) -> np.ndarray:
        noise = rng.standard_normal(leaf.shape, np.float32)
        if path[-1].key != "kernel":
            return 0.1 * noise + (1.0 if path[-1].key == "scale" else 0.0)
        # Contracted dims: all but the output's (heads × head_dim for q, k, v; else the last).
        dims = [size for size, name in zip(leaf.shape, names, strict=True) if name != "layers"]
        outputs = 2 if names[-2:] == ("heads", "head_dim") else 1
        return noise / math.sqrt(math.prod(dims[:-outputs]))

    axes = vit_ref.param_axes(cfg)
    return jax.tree_util.tree_map_with_path(draw, shapes, axes)


def batch_for(cfg: vit_ref.ViTConfig, batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, cfg.image, cfg.image, cfg.channels), "f4")
    return images, rng.integers(0, cfg.classes, batch).astype(np.int32)


def results(params: dict, images: Any, labels: Any, cfg: vit_ref.ViTConfig) -> dict:
    """The reference: logits, gradients and params after one AdamW step, in one program."""
    optimizer = verify.verify_optimizer()

    @jax.jit
    def run(params: dict, images: jax.Array, labels: jax.Array) -> dict:
        logits, _ = vit_ref.forward(params, images, cfg)
        loss, grads = jax.value_and_grad(vit_ref.loss_fn)(params, images, labels, cfg)
        stepped, _ = apply_optimizer(optimizer, grads, optimizer.init(params), params)
        return {"logits": logits, "grads": grads, "step": stepped, "loss": loss}

    return run(params, images, labels)


PLAN_FIELDS = [f.name for f in dataclasses.fields(Plan) if f.name != "mesh"]


def plan_key(plan: Plan) -> tuple:
    """A hashable plan (its mesh is a dict): the mesh's items, then every other field."""
    return (tuple(plan.mesh.items()), *(getattr(plan, name) for name in PLAN_FIELDS))


@functools.lru_cache(maxsize=16)  # bounded: see fast_compile
def _model(cfg: vit_ref.ViTConfig, key: tuple) -> tuple[ShardedViT, Any]:
    plan = Plan(dict(key[0]), **dict(zip(PLAN_FIELDS, key[1:], strict=True)))
    model = ShardedViT(cfg, plan)
    optimizer = verify.verify_optimizer()
    step = model.train_step(optimizer)

    @jax.jit
    def run(params: dict, opt_state: Any, images: jax.Array, labels: jax.Array) -> dict:
        # The public jitted functions, inlined into one program. The update is train_step's:
        # outside its shard_map (elementwise on sharded arrays) it is apply_optimizer on the
        # gradients, so that is reused; ZeRO-1/2 update inside it, so their step runs whole.
        logits = model.forward(params, images)
        loss, grads = model.loss_and_grads(params, images, labels)
        if model.zero_axis:
            stepped, _, _ = step(params, opt_state, images, labels)
        else:
            stepped, _ = apply_optimizer(optimizer, grads, opt_state, params)
        return {"logits": logits, "grads": grads, "step": stepped, "loss": loss}

    return model, lambda p, *batch: run(p, model.init_opt_state(optimizer, p), *batch)


def sharded_model(cfg: vit_ref.ViTConfig, plan: Plan) -> tuple[ShardedViT, Any]:
    """(ShardedViT, its one-program run(params, images, labels)), built once per (cfg, plan)."""
    return _model(cfg, plan_key(plan))


def sharded_results(cfg: vit_ref.ViTConfig, plan: Plan, params: dict, images, labels) -> dict:
    model, run = sharded_model(cfg, plan)
    placed = model.shard(params)
    got = run(placed, *model.shard_batch(images, labels))
    return {k: model.to_reference(v) if k in ("grads", "step") else v for k, v in got.items()}


def check_equal_to_reference(case: Case, tol: float = TOL) -> None:
    cfg, plan, batch = case
    check_plan(cfg, plan, batch)
    params = params_for(cfg)
    images, labels = batch_for(cfg, batch)
    got = sharded_results(cfg, plan, params, images, labels)
    want = results(params, images, labels, cfg)
    for what in got:
        assert_trees_close(got[what], want[what], tol, what=f"{what} of {plan} on {cfg}")


# ----------------------------------------------------------------------------- data × model


@given(case=sharded_cases(max_devices=8, sp_modes=("none",)))
@example(
    case=(vit(pool="gap", posemb="sincos2d", dim=24), Plan({"data": 3, "model": 2}, fsdp=True), 3)
)
@example(case=(vit(heads=3, dim=12, mlp_dim=12, pool="tok"), Plan({"data": 1, "model": 3}), 2))
# FSDP with each layer gathered one layer ahead (overlap), scanned and unrolled, TP inside
# (its all-reduces on two half-batches: 2 rows per data shard).
@example(case=(vit(), Plan({"data": 4, "model": 2}, fsdp=True, overlap=True), 8))
@example(case=(vit(), Plan({"data": 8}, fsdp=True, overlap=True, layers="unrolled"), 8))
# DP with each layer's gradients synced under the next layer's backward, TP inside.
@example(case=(vit(), Plan({"data": 4, "model": 2}, overlap=True), 8))
@example(case=(vit(), Plan({"data": 3}, overlap=True, layers="unrolled"), 3))
# Gradient accumulation: 2 micro-batches per data shard, synced once (DP×TP; ZeRO-1 unrolled).
@example(case=(vit(), Plan({"data": 2, "model": 2}, microbatches=2), 4))
@example(case=(vit(), Plan({"data": 2}, zero=1, microbatches=2, layers="unrolled"), 8))
# Per-layer params (layers="list"): FSDP gathering one layer ahead; ZeRO-2's per-layer scatters.
@example(case=(vit(), Plan({"data": 4, "model": 2}, fsdp=True, overlap=True, layers="list"), 8))
@example(case=(vit(), Plan({"data": 4}, zero=2, layers="list"), 4))
# ZeRO-2 with each layer's reduce-scatter of permutes one layer behind: scanned, per layer, TP.
@example(case=(vit(), Plan({"data": 4, "model": 2}, zero=2, overlap=True), 8))
@example(case=(vit(), Plan({"data": 8}, zero=2, overlap=True, layers="list"), 8))
# Plain TP's all-reduces on two half-batches a region apart: scanned (layer 0 peeled off the
# scan), per-layer params on model=4 (halving in two exchanges), one layer (nothing crosses).
@example(case=(vit(), Plan({"model": 2}, overlap=True), 2))
@example(case=(vit(heads=4), Plan({"data": 2, "model": 4}, overlap=True, layers="list"), 4))
@example(case=(vit(depth=1), Plan({"model": 2}, overlap=True), 4))
def test_data_model_meshes_match_reference(case: Case) -> None:
    check_equal_to_reference(case)


# ----------------------------------------------------------------------------- data × seq × model

SP_EXAMPLES = {
    # 2 tokens on 4 seq devices: blocks of pure padding; remat; FSDP over data=2.
    "ring": (
        vit(image=4, pool="tok"),
        Plan({"data": 2, "seq": 4}, sp="ring", fsdp=True, remat=True),
        2,
    ),
    # 5 tokens over seq=2; heads 4 = model 2 × Ulysses 2.
    "ulysses": (vit(heads=4), Plan({"data": 2, "seq": 2, "model": 2}, sp="ulysses"), 2),
    # Ulysses 2 × ring 2 (a true hybrid), 9 tokens over 4, gap pooling of padded shards.
    "usp": (
        vit(image=6, patch=2, pool="gap", heads=2, posemb="sincos2d"),
        Plan({"data": 2, "seq": 4}, sp="usp", ulysses=2),
        2,
    ),
    # 17 tokens (16 patches + class token) over model=4, FSDP over data=2.
    "megatron": (
        vit(image=16, heads=4, pool="tok"),
        Plan({"data": 2, "model": 4}, sp="megatron", fsdp=True),
        4,
    ),
    # Megatron-SP's regions as collective matmuls, 17 tokens padded to 20 over model=4.
    "megatron overlap": (
        vit(image=16, heads=4, pool="tok"),
        Plan({"data": 2, "model": 4}, sp="megatron", overlap=True),
        2,
    ),
    # ... as rings both ways (half a token block each way: local batch 2 × 5 tokens).
    "megatron overlap both ways": (
        vit(image=16, heads=4, pool="tok"),
        Plan({"data": 2, "model": 4}, sp="megatron", overlap="bidirectional"),
        4,
    ),
    # ... with DP: each layer's gradients synced over data (and model, for the LayerNorms,
    # whose gradients are partial sums over the token shards) under the next one's backward.
    "megatron overlap dp": (
        vit(image=16, heads=4, pool="tok"),
        Plan({"data": 2, "model": 2}, sp="megatron", overlap=True),
        2,
    ),
    # A ring over seq, 2 micro-batches accumulated per data shard.
    "ring accumulated": (
        vit(pool="gap"),
        Plan({"data": 2, "seq": 2}, sp="ring", microbatches=2),
        4,
    ),
    # A ring over seq, its layers synced over data × seq one layer behind.
    "ring overlap": (vit(pool="gap"), Plan({"data": 2, "seq": 2}, sp="ring", overlap=True), 2),
    # Tokens over seq=2 × model=2 (5 -> 8: a shard of pure padding), a ring over seq inside.
    "megatron ring": (vit(pool="tok"), Plan({"seq": 2, "model": 2}, sp="megatron", remat=True), 2),
    # The same split with Ulysses over seq inside (heads 4 = model 2 × Ulysses 2), DP.
    "megatron ulysses": (
        vit(heads=4),
        Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron", ulysses=2),
        2,
    ),
}


@given(case=sharded_cases(max_devices=8, sp_modes=("megatron", "ring", "ulysses", "usp")))
@example(case=SP_EXAMPLES["ring"])
@example(case=SP_EXAMPLES["ulysses"])
@example(case=SP_EXAMPLES["usp"])
@example(case=SP_EXAMPLES["megatron"])
@example(case=SP_EXAMPLES["megatron overlap"])
@example(case=SP_EXAMPLES["megatron overlap both ways"])
@example(case=SP_EXAMPLES["megatron overlap dp"])
@example(case=SP_EXAMPLES["ring overlap"])
@example(case=SP_EXAMPLES["megatron ring"])
@example(case=SP_EXAMPLES["megatron ulysses"])
def test_sequence_parallel_meshes_match_reference(case: Case) -> None:
    check_equal_to_reference(case)


@pytest.mark.parametrize(
    "plan",
    [Plan({"data": 2, "model": 2}, kernel="pallas"),
     Plan({"data": 2, "seq": 2}, sp="ring", kernel="pallas")],
    ids=["local core", "ring"],
)  # fmt: skip
def test_the_pallas_kernel_matches_reference(plan: Plan) -> None:
    """Attention on splash (Pallas' interpreter here) inside the ViT: equal to vit_ref, and
    the program does run a Pallas kernel."""
    cfg = vit(heads=4, pool="gap")
    check_equal_to_reference((cfg, plan, 2))
    model, _ = sharded_model(cfg, plan)
    images, _ = model.shard_batch(*batch_for(cfg, 2))
    assert "pallas_call" in str(jax.make_jaxpr(model.forward)(model.shard(params_for(cfg)), images))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_large_inputs_stay_finite(mode: str) -> None:
    """Images ×1e3 and query/key kernels ×30: no inf or NaN in logits, grads or the step.

    Pre-LN blocks normalise the images' scale away before attention, so the query and key
    kernels are scaled too: attention logits ~1e3 times larger, fully saturated softmax rows,
    and padded keys that must stay masked with a finite mask value.
    """
    cfg, plan, batch = SP_EXAMPLES[mode]  # its compiled program is reused from the test above
    params = params_for(cfg)
    for name in ("query", "key"):
        params["blocks"]["attn"][name]["kernel"] *= 30.0
    images, labels = batch_for(cfg, batch)
    got = sharded_results(cfg, plan, params, images * 1e3, labels)
    for what, tree in got.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            assert np.isfinite(np.asarray(leaf)).all(), f"{what}{jax.tree_util.keystr(path)}"


RING_FSDP = Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", fsdp=True)
MEGATRON_UNROLLED = Plan({"data": 2, "model": 4}, sp="megatron", layers="unrolled", remat="dots")


@pytest.mark.parametrize(
    ("precision", "plan"),
    [
        ("wide", RING_FSDP),
        ("wide", MEGATRON_UNROLLED),
        ("big_vision", Plan({"data": 2, "model": 4}, fsdp=True)),
        ("big_vision", MEGATRON_UNROLLED),
    ],
    ids=[
        "wide ring+TP+FSDP",
        "wide megatron unrolled",
        "big_vision FSDP×TP",
        "big_vision megatron",
    ],
)
def test_bfloat16_within_its_documented_bound(precision: str, plan: Plan) -> None:
    """bf16 compute under each precision policy, sharded vs vit_ref with the same policy:
    every leaf within verify.TOLERANCE["bfloat16"] but the key bias, whose exact gradient is
    zero (softmax ignores a shift shared by all keys): with bf16 logits both sides' values are
    rounding noise (measured 5.2e-2 apart), so each is held under 1e-3 of the largest gradient
    instead. Under "big_vision" the plans run the local core, whose bf16 softmax is the
    reference's; a ring keeps float32 softmax statistics (flash-style)."""
    cfg = vit(dtype="bfloat16", heads=4, pool="gap", precision=precision)
    params = params_for(cfg)
    images, labels = batch_for(cfg, 2)
    got = sharded_results(cfg, plan, params, images, labels)
    want = results(params, images, labels, cfg)
    for side in (got, want):
        key_bias = side["grads"]["blocks"]["attn"]["key"].pop("bias")
        largest = max(
            np.linalg.norm(np.asarray(g, np.float64)) for g in jax.tree.leaves(side["grads"])
        )
        assert np.linalg.norm(np.asarray(key_bias, np.float64)) < 1e-3 * largest
    for what in got:
        assert_trees_close(got[what], want[what], verify.TOLERANCE["bfloat16"], what=what)


@pytest.mark.parametrize(
    "plan",
    [
        Plan({"data": 4}, grad_sync="bfloat16"),
        Plan({"data": 2, "model": 2}, zero=1, grad_sync="bfloat16"),
        Plan({"data": 2, "seq": 2}, sp="ring", grad_sync="bfloat16"),
        Plan({"data": 4}, grad_sync="bfloat16", overlap=True),
    ],
    ids=["DP", "ZeRO-1×TP", "DP×ring", "DP overlap"],
)
def test_bf16_gradient_sync_rounds_the_partials_and_keeps_the_contract(plan: Plan) -> None:
    """``grad_sync="bfloat16"``: the gradient buckets are all-reduced in bf16 (each device's
    partial rounded to 8 mantissa bits first, as XLA's partitioner sends a bf16 model's), the
    loss in float32. Within verify's bf16 bound of the reference but not equal to the float32
    sync (the rounding happens); the contract exact on CPU, where XLA:CPU widens the bf16
    all-reduce to float32 and merges the loss back in (the TPU compiler halves the bytes:
    ``tests/run/test_target.py``)."""
    cfg = vit()
    check_equal_to_reference((cfg, plan, 4), verify.tolerance(cfg, plan))
    params, (images, labels) = params_for(cfg), batch_for(cfg, 4)
    f32 = dataclasses.replace(plan, grad_sync="float32")
    rounded, exact = (sharded_results(cfg, p, params, images, labels) for p in (plan, f32))
    assert max_error(rounded["grads"], exact["grads"]) > 1e-6  # bf16 really travelled
    model = sharded_model(cfg, plan)[0]
    optimizer = report.default_optimizer()
    lowered = model.train_step(optimizer).lower(*report.step_args(model, 4, optimizer))
    written = ledger.parse_hlo(lowered.as_text(dialect="hlo"), model.mesh)
    assert {c.dtypes for c in written if c.kind == "all-reduce" and "data" in c.axes} >= {
        ("bf16",),
        ("f32",),  # the gradient bucket, and the loss apart
    }
    assert report.model_report(model, 4).contract_ok


# ----------------------------------------------------------------------------- FSDP memory

FSDP_N = 4
FSDP_CFG = vit(pool="tok")  # dim 16: every embed dim splits over data=4


def local_bytes(tree: Any) -> int:
    """Bytes one device holds of every array in ``tree`` (all devices hold equal shares here)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def train_step_args(model: ShardedViT) -> tuple:
    """(params, opt_state, images, labels) placed for ``model`` (fresh: the step donates)."""
    params = model.shard(params_for(FSDP_CFG))
    state = model.init_opt_state(verify.verify_optimizer(), params)
    return (params, state, *model.shard_batch(*batch_for(FSDP_CFG, FSDP_N)))


@functools.cache
def compiled_train_step(fsdp: bool, overlap: bool = False) -> tuple[ShardedViT, Any]:
    """The real (donating) train step on data=4, with and without FSDP (``overlap``: each
    layer gathered one layer ahead, or DP's synced one behind), compiled once."""
    model, _ = sharded_model(FSDP_CFG, Plan({"data": FSDP_N}, fsdp=fsdp, overlap=overlap))
    step = model.train_step(verify.verify_optimizer())
    return model, step.lower(*train_step_args(model)).compile()


def test_fsdp_holds_each_split_param_at_one_nth_per_device() -> None:
    n, split, args, argument_bytes = FSDP_N, {}, {}, {}
    for fsdp in (False, True):
        model, compiled = compiled_train_step(fsdp)
        args[fsdp] = train_step_args(model)
        argument_bytes[fsdp] = compiled.memory_analysis().argument_size_in_bytes
        split[fsdp] = {
            jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(args[fsdp][0])
            if "data" in leaf.sharding.spec
        }
    # Exactly the leaves with an "embed" dim are split, each holding 1/n of it per device.
    embed_leaves = {
        jax.tree_util.keystr(path)
        for path, names in jax.tree_util.tree_leaves_with_path(
            vit_ref.param_axes(FSDP_CFG), is_leaf=lambda x: isinstance(x, tuple)
        )
        if "embed" in names
    }
    assert not split[False] and set(split[True]) == embed_leaves
    for name, leaf in split[True].items():
        dim = list(leaf.sharding.spec).index("data")
        want = (*leaf.shape[:dim], leaf.shape[dim] // n, *leaf.shape[dim + 1 :])
        assert {s.data.shape for s in leaf.addressable_shards} == {want}, name
        assert len({s.device for s in leaf.addressable_shards}) == n
    # XLA's argument bytes per device: params, AdamW's mu and nu (split like the params), the
    # step count and the batch shard. FSDP saves (1 - 1/n) of three copies of the split params.
    for fsdp in (False, True):
        assert argument_bytes[fsdp] == local_bytes(args[fsdp]), fsdp
    split_bytes = sum(leaf.nbytes for leaf in split[True].values())
    assert argument_bytes[False] - argument_bytes[True] == 3 * split_bytes * (1 - 1 / n)


def test_dp_overlap_holds_at_most_one_more_layer() -> None:
    """DP's ``overlap`` carries layer i + 1 through layer i's step to sync its gradients one
    layer behind: on XLA:CPU the step's temporaries grow by at most one layer's params
    (float32, as stored) over the plain step's. (FSDP's ring of gradient permutes is held
    on the TPU compiler, ``tests/run/test_target.py``: XLA:CPU keeps each ring's cotangent
    alive across its sequential permutes, +3.4 layers on Ti/16.)"""
    temp = {o: compiled_train_step(False, o)[1].memory_analysis().temp_size_in_bytes
            for o in (False, True)}  # fmt: skip
    layer = sum(leaf[0].nbytes for leaf in jax.tree.leaves(params_for(FSDP_CFG)["blocks"]))
    assert temp[True] <= temp[False] + layer, (temp, layer)


def test_train_step_donates_and_matches_reference() -> None:
    """The real train_step (FSDP, donated buffers) equals vit_ref's step and loss."""
    model, compiled = compiled_train_step(True)
    args = train_step_args(model)
    stepped, _, metrics = compiled(*args)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(args[:2]))  # donated
    want = results(params_for(FSDP_CFG), *batch_for(FSDP_CFG, FSDP_N), FSDP_CFG)
    assert_trees_close(stepped, want["step"], TOL, what="train_step")
    assert_trees_close(metrics["loss"], want["loss"], TOL, what="loss")


# ----------------------------------------------------------------------------- plan errors

CFG = vit(dim=12, heads=6, mlp_dim=10)
PLAN_ERRORS = [
    (dict(batch=6), Plan({"data": 4}), "batch=6 is not divisible by data=4"),
    ({}, Plan({"model": 4}), "heads=6 is not divisible by model=4"),
    ({}, Plan({"model": 3}), "mlp_dim=10 is not divisible by model=3"),
    ({}, Plan({"data": 8}, fsdp=True), "dim=12 is not divisible by data=8"),
    ({}, Plan({"stage": 4}, pp="1f1b"), "depth=2 is not divisible by stage×virtual = 4×1"),
    (
        {},
        Plan({"stage": 2}, pp="interleaved", virtual=2, microbatches=2),
        "depth=2 is not divisible by stage×virtual = 2×2",
    ),
    (
        dict(batch=6),
        Plan({"data": 2, "stage": 2}, pp="gpipe", microbatches=2),
        r"The data-local batch \(6//2=3\) is not divisible by --microbatches 2",
    ),
    (
        {},
        Plan({"stage": 2}, pp="zb", microbatches=1),
        r"at least as many microbatches as stages \(M=1 < S=2\)",
    ),
    (
        {},
        Plan({"stage": 2}, pp="interleaved", microbatches=3),
        r"the microbatches \(M=3\) divisible by the stages \(S=2\)",
    ),
    (
        dict(batch=3),
        Plan({"seq": 2, "model": 2}, sp="megatron", overlap="bidirectional"),
        r"--overlap bidirectional halves each device's 3 token rows \(local batch × 1 tokens\)",
    ),
    ({}, Plan({"seq": 4}, sp="ulysses"), r"heads per model shard \(6//1=6\) divisible by seq=4"),
    ({}, Plan({"seq": 2, "model": 2}, sp="ulysses"), r"\(6//2=3\) divisible by seq=2"),
    (
        {},
        Plan({"seq": 4, "model": 2}, sp="megatron", ulysses=2),
        "Ulysses degree 2 must divide both the seq axis size 4 and the local head count 3",
    ),
    (
        {},
        Plan({"seq": 4}, sp="usp", ulysses=3),
        "Ulysses degree 3 must divide both the seq axis size 4 and the local head count 6",
    ),
    (
        {},
        Plan({"seq": 4, "model": 2}, sp="usp", ulysses=2),
        "Ulysses degree 2 must divide both the seq axis size 4 and the local head count 3",
    ),
]


def assert_one_sentence(err: Exception) -> None:
    message = str(err)
    assert "\n" not in message and message.endswith(".") and ". " not in message, message


@pytest.mark.parametrize(("kwargs", "plan", "match"), PLAN_ERRORS)
def test_check_plan_names_dimension_axis_and_sizes(kwargs: dict, plan: Plan, match: str) -> None:
    with pytest.raises(PlanError, match=match) as err:
        check_plan(CFG, plan, kwargs.get("batch"))
    assert_one_sentence(err.value)
    if "batch" in kwargs:
        with pytest.raises(PlanError, match=match):
            ShardedViT(CFG, plan).check_batch(kwargs["batch"])
    else:  # the constructor validates before it builds anything
        with pytest.raises(PlanError, match=match):
            ShardedViT(CFG, plan)


def test_a_plan_needing_more_devices_than_there_are_is_one_sentence() -> None:
    with pytest.raises(PlanError, match="needs 9 devices but only 8") as err:
        ShardedViT(CFG, Plan({"data": 3, "seq": 3}, sp="ring"))
    assert_one_sentence(err.value)


# The default verify matrix runs once, through the CLI: tests/run/test_cli.py.


# ----------------------------------------------------------------------------- ZeRO memory

ZERO_MESH = {"data": 4, "model": 2}


@functools.cache
def zero_memory(zero: int, depth: int) -> Any:
    """``memory_analysis`` of the train step on data=4 × model=2 at a ZeRO level (compiled)."""
    cfg = dataclasses.replace(FSDP_CFG, depth=depth)
    return report.measure_step(ShardedViT(cfg, Plan(ZERO_MESH, zero=zero)), 8).memory


def zero_split_bytes(depth: int, blocks_only: bool = False) -> int:
    """Bytes per device (model-split) of the leaves ZeRO splits over data, before the split."""
    cfg = dataclasses.replace(FSDP_CFG, depth=depth)
    g = cost.geometry(cfg, Plan(ZERO_MESH, zero=1), 8)
    n = ZERO_MESH["data"]
    split = [leaf for leaf in cost_params.param_leaves(g) if "data" in leaf.split]
    return sum(leaf.local * n * 4 for leaf in split if leaf.in_blocks or not blocks_only)


def test_zero_holds_the_optimizer_state_and_gradients_at_one_nth() -> None:
    """ZeRO-1: AdamW's mu and nu of every embed-split leaf at 1/4 per device, the params whole
    (argument and output bytes, exact). ZeRO-2 also frees (n−1)/n of every layer's gradient
    from the step's temp memory: each added layer saves that (measured at dim 64, exact:
    98,816 B saved at depth 2, 199,424 B at depth 4, the 100,608 B between them 3/4 of two
    layers' gradients)."""
    frac = 1 - 1 / ZERO_MESH["data"]
    none, one, two = (zero_memory(z, 2) for z in (0, 1, 2))
    state_saved = 2 * frac * zero_split_bytes(2)  # mu and nu
    assert none.argument - one.argument == state_saved
    assert none.output - one.output == state_saved
    assert (two.argument, two.output) == (one.argument, one.output)
    assert two.temp < one.temp
    # One more layer: ZeRO-2 saves (n−1)/n of its gradient more (here 2,688 B for 2,592: XLA
    # aligns these small buffers; at dim 64 it is exact).
    saved = {d: zero_memory(1, d).temp - zero_memory(2, d).temp for d in (2, 3)}
    layer = zero_split_bytes(3, blocks_only=True) - zero_split_bytes(2, blocks_only=True)
    assert saved[3] - saved[2] == pytest.approx(frac * layer, rel=0.05)


@pytest.mark.parametrize(("mesh", "want"), [({"data": 8}, 1), ({"data": 4, "model": 2}, 6)])
def test_the_loss_rides_in_the_gradient_bucket(mesh: dict, want: int) -> None:
    """The loss share joins the step-end gradient bucket of its axes (``ShardedModel.riding``),
    so the program as written has one all-reduce there, not a second one for the loss that a
    compiler may or may not merge (the TPU compiler kept ViT-B/16's apart: 2 where the
    contract has 1). The counts are of the lowered program (each loop body once): DP 2 -> 1,
    DP×TP 7 -> 6 with the loss riding."""
    cfg = vit_ref.variant("mu", depth=2)
    model = ShardedViT(cfg, Plan(mesh))
    optimizer = report.default_optimizer()
    lowered = model.train_step(optimizer).lower(*report.step_args(model, 16, optimizer))
    assert lowered.as_text().count('"stablehlo.all_reduce"') == want
