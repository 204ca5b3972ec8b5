"""The reference ViT: shapes, param counts, inits, numerics, training and config validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vit_ref
from vit_ref import model as ref_model

TINY = vit_ref.variant(
    "mu", image=16, patch=4, dim=16, depth=2, heads=2, mlp_dim=32, classes=5, head_zeroinit=False
)


def count_params(cfg: vit_ref.ViTConfig) -> int:
    shapes = jax.eval_shape(lambda k: vit_ref.init(k, cfg), jax.random.key(0))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def images_for(cfg: vit_ref.ViTConfig, batch: int = 2, seed: int = 1) -> jax.Array:
    shape = (batch, cfg.image, cfg.image, cfg.channels)
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize(
    ("name", "expected"), [("B/16", 86_566_120), ("S/16", 22_049_896), ("H/14", 632_043_240)]
)
def test_param_counts_match_big_vision(name, expected):
    cfg = vit_ref.variant(name, pool="gap", posemb="learn")
    assert count_params(cfg) == expected
    assert count_params(dataclasses.replace(cfg, pool="tok")) == expected + cfg.dim


@pytest.mark.parametrize("name", vit_ref.VARIANT_NAMES)
@pytest.mark.parametrize("pool", ["tok", "gap"])
def test_output_shapes_for_every_variant(name, pool):
    cfg = vit_ref.variant(name, pool=pool)
    params = jax.eval_shape(lambda k: vit_ref.init(k, cfg), jax.random.key(0))
    images = jax.ShapeDtypeStruct((3, cfg.image, cfg.image, cfg.channels), jnp.float32)
    logits, inter = jax.eval_shape(lambda p, x: vit_ref.forward(p, x, cfg), params, images)
    assert logits.shape == (3, cfg.classes) and logits.dtype == jnp.float32
    assert inter["embedding"].shape == (3, cfg.num_tokens, cfg.dim)
    blocks = {k for k in inter if k.startswith("block_")}
    assert blocks == {f"block_{i}" for i in range(cfg.depth)}
    assert inter["pre_logits"].shape == (3, cfg.dim)


def test_param_axes_cover_every_leaf_with_matching_rank():
    for pool in ("tok", "gap"):
        for posemb in ("learn", "sincos2d"):
            cfg = dataclasses.replace(TINY, pool=pool, posemb=posemb)
            params = vit_ref.init(jax.random.key(0), cfg)
            axes = vit_ref.param_axes(cfg)
            flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
            assert jax.tree.structure(params) == jax.tree.structure(
                axes, is_leaf=lambda x: isinstance(x, tuple)
            )
            for leaf, names in zip(jax.tree.leaves(params), flat_axes, strict=True):
                assert leaf.ndim == len(names)


def test_sincos2d_equals_closed_form():
    grid, dim = 3, 8
    pe = vit_ref.posemb_sincos2d(grid, dim)[0]
    quarter = dim // 4
    for row in range(grid):
        for col in range(grid):
            token = row * grid + col
            for j in range(quarter):
                omega = 10_000.0 ** (-j / (quarter - 1))
                expected = [
                    np.sin(col * omega),
                    np.cos(col * omega),
                    np.sin(row * omega),
                    np.cos(row * omega),
                ]
                got = [pe[token, q * quarter + j] for q in range(4)]
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_sincos2d_is_fixed_and_has_no_param():
    cfg = dataclasses.replace(TINY, posemb="sincos2d")
    params = vit_ref.init(jax.random.key(0), cfg)
    assert "pos_embedding" not in params
    _, inter = vit_ref.forward(params, images_for(cfg), cfg)
    patches = ref_model.patchify(images_for(cfg), cfg.patch)
    emb = patches @ params["embedding"]["kernel"] + params["embedding"]["bias"][None, None]
    expected = emb + vit_ref.posemb_sincos2d(cfg.grid, cfg.dim)
    np.testing.assert_allclose(inter["embedding"], expected, rtol=1e-5, atol=1e-6)


def test_patch_embedding_equals_conv():
    cfg = TINY
    params = vit_ref.init(jax.random.key(0), cfg)
    images = images_for(cfg)
    kernel = params["embedding"]["kernel"].reshape(cfg.patch, cfg.patch, cfg.channels, cfg.dim)
    conv = jax.lax.conv_general_dilated(
        images, kernel, (cfg.patch, cfg.patch), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    _, inter = vit_ref.forward(params, images, cfg)
    expected = conv.reshape(2, -1, cfg.dim) + params["pos_embedding"]
    np.testing.assert_allclose(inter["embedding"], expected, rtol=1e-5, atol=1e-5)


def test_tok_pooling_prepends_zero_class_token_and_reads_token_zero():
    cfg = dataclasses.replace(TINY, pool="tok")
    params = vit_ref.init(jax.random.key(0), cfg)
    assert not params["cls"].any()
    _, inter = vit_ref.forward(params, images_for(cfg), cfg)
    assert inter["embedding"].shape[1] == cfg.num_patches + 1
    np.testing.assert_array_equal(inter["embedding"][:, 0], 0.0)
    np.testing.assert_array_equal(inter["pre_logits"], inter["encoded"][:, 0])


def test_gap_pooling_is_mean_over_tokens():
    cfg = dataclasses.replace(TINY, pool="gap")
    params = vit_ref.init(jax.random.key(0), cfg)
    _, inter = vit_ref.forward(params, images_for(cfg), cfg)
    assert inter["embedding"].shape[1] == cfg.num_patches
    np.testing.assert_allclose(inter["pre_logits"], inter["encoded"].mean(1), rtol=1e-6)


def test_inits_follow_big_vision():
    cfg = vit_ref.variant("S/16")
    params = vit_ref.init(jax.random.key(0), cfg)
    blocks = params["blocks"]
    assert not params["head"]["kernel"].any() and not params["head"]["bias"].any()
    assert not params["embedding"]["bias"].any() and not blocks["attn"]["query"]["bias"].any()
    np.testing.assert_allclose(params["pos_embedding"].std(), 1 / np.sqrt(cfg.dim), rtol=0.02)
    # lecun normal (truncated): std = sqrt(1 / fan_in); xavier uniform: limit sqrt(6/(in+out)).
    np.testing.assert_allclose(params["embedding"]["kernel"].std(), np.sqrt(1 / 768), rtol=0.05)
    limit = np.sqrt(6 / (cfg.dim + cfg.mlp_dim))
    fc1 = blocks["mlp"]["fc1"]["kernel"]
    assert float(jnp.abs(fc1).max()) <= limit
    np.testing.assert_allclose(fc1.std(), limit / np.sqrt(3), rtol=0.02)
    np.testing.assert_allclose(blocks["mlp"]["fc1"]["bias"].std(), 1e-6, rtol=0.1)
    assert blocks["attn"]["query"]["kernel"].shape == (12, 384, 6, 64)


def test_same_key_is_bitwise_identical_and_different_keys_differ():
    p1, p2 = (vit_ref.init(jax.random.key(7), TINY) for _ in range(2))
    p3 = vit_ref.init(jax.random.key(8), TINY)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)
    l1, _ = vit_ref.forward(p1, images_for(TINY), TINY)
    l2, _ = vit_ref.forward(p2, images_for(TINY), TINY)
    l3, _ = vit_ref.forward(p3, images_for(TINY), TINY)
    np.testing.assert_array_equal(l1, l2)
    assert not np.allclose(l1, l3)
    assert not np.allclose(
        p1["blocks"]["attn"]["key"]["kernel"], p3["blocks"]["attn"]["key"]["kernel"]
    )


def test_gradients_match_finite_differences():
    jax.config.update("jax_enable_x64", True)
    try:
        cfg = TINY
        params = jax.tree.map(lambda x: x.astype(jnp.float64), vit_ref.init(jax.random.key(0), cfg))
        images = images_for(cfg).astype(jnp.float64)
        labels = jnp.array([1, 3])

        def loss(p):
            return vit_ref.loss_fn(p, images, labels, cfg)

        grads = jax.grad(loss)(params)
        rng = np.random.default_rng(0)
        leaves, treedef = jax.tree.flatten(params)
        for i, leaf in enumerate(leaves):
            direction = rng.standard_normal(leaf.shape)
            eps = 1e-5

            def shifted(sign, i=i, leaf=leaf, direction=direction, eps=eps):
                moved = list(leaves)
                moved[i] = leaf + sign * eps * direction
                return loss(jax.tree.unflatten(treedef, moved))

            numeric = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
            analytic = float(jnp.sum(jax.tree.leaves(grads)[i] * direction))
            np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-9)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_train_step_overfits_a_fixed_batch():
    cfg = vit_ref.variant("mu", classes=10)
    params = vit_ref.init(jax.random.key(0), cfg)
    optimizer = vit_ref.make_optimizer(learning_rate=3e-3)
    opt_state = optimizer.init(params)
    step = vit_ref.make_train_step(cfg, optimizer)
    images = images_for(cfg, batch=32)
    labels = jax.random.randint(jax.random.key(2), (32,), 0, cfg.classes)
    first = None
    for _ in range(100):
        params, opt_state, metrics = step(params, opt_state, images, labels)
        first = float(metrics["loss"]) if first is None else first
    final = vit_ref.make_eval_step(cfg)(params, images, labels)
    # ln(10) ≈ 2.30 at the start; memorising 32 random labels drives it 20× lower.
    assert float(final["loss"]) < first / 20
    assert float(final["accuracy"]) == 1.0


def test_bfloat16_compute_agrees_with_float32():
    cfg32 = dataclasses.replace(TINY, depth=2)
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
    params = vit_ref.init(jax.random.key(0), cfg32)
    images = images_for(cfg32, batch=4)
    l32, _ = vit_ref.forward(params, images, cfg32)
    l16, _ = vit_ref.forward(params, images, cfg16)
    assert l16.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3) per matmul input; a few layers
    # compound it: the documented bound for logits is 2e-2 relative L2.
    rel = float(jnp.linalg.norm(l16 - l32) / jnp.linalg.norm(l32))
    assert rel < 2e-2, rel


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (dict(image=30, patch=8), ["image=30", "patch=8"]),
        (dict(dim=30, heads=4), ["dim=30", "heads=4"]),
        (dict(dim=18, heads=2, posemb="sincos2d"), ["sincos2d", "dim=18"]),
        (dict(pool="cls"), ["pool", "'cls'"]),
        (dict(posemb="rope"), ["posemb", "'rope'"]),
        (dict(dtype="float16"), ["dtype", "'float16'"]),
        (dict(depth=0), ["depth", "0"]),
    ],
)
def test_bad_configs_raise_value_error_naming_field_and_values(overrides, words):
    with pytest.raises(ValueError) as err:
        vit_ref.variant("mu", **overrides)
    for word in words:
        assert word in str(err.value)


def test_unknown_variant_and_field_raise():
    with pytest.raises(ValueError, match="Unknown ViT variant 'G/14'"):
        vit_ref.variant("G/14")
    with pytest.raises(ValueError, match="width"):
        vit_ref.variant("mu", width=3)
    with pytest.raises(ValueError, match="patch=3"):
        dataclasses.replace(vit_ref.variant("mu"), patch=3)


def test_wrong_image_shape_is_a_clear_error():
    params = vit_ref.init(jax.random.key(0), TINY)
    with pytest.raises(ValueError, match="NHWC"):
        vit_ref.forward(params, jnp.zeros((2, 3, 16, 16)), TINY)


def test_optimizer_is_adamw():
    opt = vit_ref.make_optimizer(1e-3)
    assert isinstance(opt, optax.GradientTransformation)


@pytest.mark.parametrize(("scores", "widest"), [(None, "f32"), (jnp.bfloat16, "bf16")])
def test_attention_scores_stay_in_the_dtype_asked_for(scores, widest) -> None:
    """bf16 q, k, v: the [b, h, q, s] logits and softmax are float32 by default and bf16 when
    asked ("big_vision"); a float64 NumPy scale would silently promote them to float32."""
    q = jnp.ones((2, 5, 3, 4), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda q: ref_model.attention_core(q, q, q, scores=scores))(q))
    assert f"{widest}[2,3,5,5] = dot_general" in jaxpr  # the logits
    assert f"{widest}[2,3,5,5] = div" in jaxpr  # the probabilities


def test_big_vision_precision_runs_the_residual_stream_in_bf16() -> None:
    cfg = dataclasses.replace(TINY, dtype="bfloat16", precision="big_vision")
    params = vit_ref.init(jax.random.key(0), cfg)
    _, inter = vit_ref.forward(params, images_for(cfg), cfg)
    assert inter["embedding"].dtype == inter["block_0"].dtype == jnp.bfloat16
    wide = dataclasses.replace(cfg, precision="wide")
    assert vit_ref.forward(params, images_for(cfg), wide)[1]["block_0"].dtype == jnp.float32


def test_unknown_precision_is_one_sentence() -> None:
    with pytest.raises(ValueError, match="precision='bf16' is not one of wide, big_vision"):
        dataclasses.replace(TINY, precision="bf16")


def test_as_layers_round_trips_and_a_mismatched_form_is_one_sentence() -> None:
    """``as_layers``: the stack as a list of per-layer trees and back, bitwise; ``forward``
    refuses params in the other form than its ``layers`` runs, naming the fix."""
    cfg = vit_ref.ViTConfig(image=8, patch=4, classes=3, dim=8, depth=3, heads=2, mlp_dim=8)
    params = vit_ref.init(jax.random.key(0), cfg)
    per_layer = vit_ref.as_layers(params, "list")
    assert len(per_layer["blocks"]) == 3 and vit_ref.as_layers(per_layer, "list") is per_layer
    back = vit_ref.as_layers(per_layer, "unrolled")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        assert a.shape == b.shape and bool((a == b).all())
    axes = vit_ref.param_axes(cfg, "list")
    assert jax.tree.structure(per_layer) == jax.tree.structure(
        jax.tree.map(lambda _: 0, axes, is_leaf=lambda x: isinstance(x, tuple))
    )
    images = jnp.zeros((1, 8, 8, 3))
    with pytest.raises(ValueError, match=r"as_layers\(params, 'list'\)"):
        vit_ref.forward(params, images, cfg, layers="list")
    with pytest.raises(ValueError, match="run them with layers='list'"):
        vit_ref.forward(per_layer, images, cfg, layers="scan")
    with pytest.raises(ValueError, match="Unknown layers 'loop'"):
        vit_ref.as_layers(params, "loop")
