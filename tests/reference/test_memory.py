"""vit_ref's train step keeps what its backward needs and no float32 stack of attention scores:
``memory_analysis`` and the compiled program on CPU (deterministic), per remat policy and
with micro-batches; the
saved activations per precision policy (``saved_residuals``, deterministic); scanned and
unrolled layers and per-layer params compute the same, and per-layer params need no gradient
assembly."""

from __future__ import annotations

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.ad_checkpoint import saved_residuals

import vit_ref

CFG = vit_ref.ViTConfig(
    image=32, patch=4, channels=3, classes=10, dim=64, depth=4, heads=4, mlp_dim=256,
    pool="gap", dtype="bfloat16", head_zeroinit=False,
)  # fmt: skip
BATCH = 16
# [depth, batch, heads, tokens, tokens] float32: every layer's softmax input, stacked by scan.
SCORES = f"f32[{CFG.depth},{BATCH},{CFG.heads},{CFG.num_tokens},{CFG.num_tokens}]"


def _compiled(remat: str, layers: str = "scan", microbatches: int = 1):
    optimizer = vit_ref.make_optimizer()
    params = jax.eval_shape(lambda: vit_ref.as_layers(vit_ref.init(jax.random.key(0), CFG), layers))
    state = jax.eval_shape(optimizer.init, params)
    images = jax.ShapeDtypeStruct((BATCH, CFG.image, CFG.image, CFG.channels), jnp.float32)
    labels = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    step = vit_ref.make_train_step(CFG, optimizer, remat, layers, microbatches)
    return step.lower(params, state, images, labels).compile()


@pytest.fixture(scope="module")
def programs() -> dict:
    return {policy: _compiled(policy) for policy in ("none", "dots", "full")}


def test_dots_keeps_no_float32_scores_and_less_than_half_the_temp(programs) -> None:
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in programs.items()}
    assert SCORES in programs["none"].as_text()  # what "none" stacks: the float32 scores
    assert SCORES not in programs["dots"].as_text()
    assert temp["dots"] < 0.5 * temp["none"]  # measured: 22.2 MB against 59.6 MB
    assert temp["full"] < temp["dots"]  # measured: 14.6 MB


def test_unrolled_layers_stack_nothing_per_layer(programs) -> None:
    """Unrolled, no loop is left and nothing is stacked per layer: less temp than the scan."""
    unrolled = _compiled("none", "unrolled")
    assert " while(" in programs["none"].as_text() and " while(" not in unrolled.as_text()
    assert SCORES not in unrolled.as_text()
    temp = unrolled.memory_analysis().temp_size_in_bytes
    assert temp < programs["none"].memory_analysis().temp_size_in_bytes  # 40.4 MB vs 59.6 MB


def test_per_layer_params_need_no_gradient_assembly() -> None:
    """Over the stack, each layer's weights are sliced out (124 slices here) and each layer's
    gradient is padded to the stack's shape and summed into it (64 pads: 16 leaves × 4 layers),
    before AdamW runs over the stacks; with a list of per-layer params (``layers="list"``)
    neither is left, and the update fuses into each layer's gradient (on a v5e: +2% at batch
    32, docs/performance.md)."""
    ops = {}
    for layers in ("unrolled", "list"):
        text = _compiled("none", layers).as_text()
        ops[layers] = {op: len(re.findall(rf"= \S+ {op}\(", text)) for op in ("pad", "slice")}
    leaves = len(jax.tree.leaves(vit_ref.init(jax.random.key(0), CFG)["blocks"]))
    assert ops["unrolled"]["pad"] == leaves * CFG.depth and ops["unrolled"]["slice"] > 0, ops
    assert ops["list"] == {"pad": 0, "slice": 0}, ops


def test_micro_batches_hold_one_micro_batchs_activations() -> None:
    """Gradient accumulation over 4 micro-batches keeps a quarter of the batch's activations
    live, plus one float32 gradient sum (on the chip: ViT-B/16 batch 256 in 2.78 GB of
    temporaries instead of 14.68, docs/performance.md)."""
    temp = {m: _compiled("none", "unrolled", m).memory_analysis().temp_size_in_bytes
            for m in (1, 4)}  # fmt: skip
    assert temp[4] < 0.5 * temp[1], temp  # measured: 11.3 MB against 40.4 MB


def _saved_float32(precision: str) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every float32 activation the backward of a scanned, "dots" step keeps."""
    cfg = dataclasses.replace(CFG, precision=precision)
    params = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    images = jnp.zeros((BATCH, CFG.image, CFG.image, CFG.channels))
    labels = jnp.zeros((BATCH,), jnp.int32)
    loss = lambda p: vit_ref.loss_fn(p, images, labels, cfg, None, "dots")  # noqa: E731
    saved = saved_residuals(loss, params)
    return [
        (aval.shape, aval.size * 4)
        for aval, why in saved
        if aval.dtype == jnp.float32 and "argument" not in why
    ]


def test_big_vision_precision_keeps_no_float32_residual_stream_per_layer() -> None:
    """ "wide" saves the float32 residual stream of every layer ([depth, b, t, d], the scan's
    carry); "big_vision" saves it in bf16: exactly that stack's float32 bytes are gone."""
    stack = (CFG.depth, BATCH, CFG.num_tokens, CFG.dim)
    wide, big_vision = _saved_float32("wide"), _saved_float32("big_vision")
    assert [shape for shape, _ in wide].count(stack) == 1
    assert not [shape for shape, _ in big_vision if len(shape) == 4]
    gone = sum(b for _, b in wide) - sum(b for _, b in big_vision)
    assert gone == 4 * CFG.depth * BATCH * CFG.num_tokens * CFG.dim  # 1,048,576 bytes


def test_the_default_train_step_recomputes_the_elementwise_work() -> None:
    default = inspect.signature(vit_ref.make_train_step).parameters["remat"].default
    assert default == "dots"


def test_every_policy_and_layer_loop_computes_the_same_loss_and_gradients() -> None:
    """Recomputation, unrolling and per-layer params change what is kept, not what is
    computed (float32)."""
    cfg = vit_ref.ViTConfig(
        image=16, patch=4, channels=3, classes=5, dim=32, depth=2, heads=4, mlp_dim=64,
        head_zeroinit=False,
    )  # fmt: skip
    params = vit_ref.init(jax.random.key(0), cfg)
    images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
    labels = jnp.arange(4) % cfg.classes
    grad = jax.grad(vit_ref.loss_fn)
    grads = {p: grad(params, images, labels, cfg, None, p) for p in ("none", "dots", "full")}
    grads["unrolled"] = grad(params, images, labels, cfg, None, "none", "unrolled")
    grads["unrolled dots"] = grad(params, images, labels, cfg, None, "dots", "unrolled")
    per_layer = vit_ref.as_layers(params, "list")
    grads["list"] = vit_ref.as_layers(grad(per_layer, images, labels, cfg, None, "none", "list"),
                                      "scan")  # fmt: skip
    both = jax.value_and_grad(vit_ref.loss_fn)
    loss, grads["2 micro-batches"] = vit_ref.accumulated_grads(
        lambda p, x, y: both(p, x, y, cfg), params, images, labels, 2
    )
    assert jnp.allclose(loss, vit_ref.loss_fn(params, images, labels, cfg), rtol=1e-6)
    for policy in ("dots", "full", "unrolled", "unrolled dots", "list", "2 micro-batches"):
        for a, b in zip(
            jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"]), strict=True
        ):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7), policy
