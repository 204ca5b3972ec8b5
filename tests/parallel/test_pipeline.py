"""The pipeline engine against an unsharded reference, on a model that is not a ViT.

A residual MLP cut into S·V chunks (``stage_fn``; its hidden layer split over ``model`` with
``tensor.mlp_tp`` when the mesh has one) and a squared-error head (``loss_fn``), microbatches
split over ``data``: the loss, every chunk's gradient, the head's gradient and the input
gradient of ``pipeline_grads`` equal ``jax.grad`` of the plain loop, for every schedule. Then
the properties the schedules promise: buffers poisoned with NaN change nothing (no unwritten
slot is read), the stash holds what the schedule keeps in flight (GPipe's temp memory grows
with M, 1F1B's and ZB-H1's do not: memory_analysis), no buffer is copied whole each tick,
and the compiled program sends one activation per tick each way in the ticks where some stage
sends.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardkit import ledger, testing
from shardkit.models.staged import stage_ledger
from shardkit.parallel import pipeline as pl
from shardkit.parallel.pipeline import schedules as sc
from shardkit.parallel.tensor import mlp_tp

B, T, D_IN, D, F, D_OUT = 2, 2, 5, 8, 16, 3  # rows, tokens, input, width, hidden, output
AXES = ("data", "stage", "model")


def mesh_of(data: int, stage: int, model: int):
    devices = np.asarray(jax.devices()[: data * stage * model], dtype=object)
    return jax.sharding.Mesh(
        devices.reshape(data, stage, model), AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
    )  # fmt: skip


def stage_fn(p, x, axis=None):
    """One chunk: x + MLP(LN-free x), hidden split over ``axis`` (None: unsplit)."""
    return x + mlp_tp(x, p, axis, jnp.tanh)


def ring_stage_fn(p, x, axis="model"):
    """A chunk with a ppermute inside: tokens split over ``axis``, each device's block mixed
    with its ring neighbour's (a global roll by one block) before the MLP."""
    n = jax.lax.axis_size(axis)
    shifted = jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
    return stage_fn(p, x + 0.5 * shifted)


def ring_reference_fn(p, x, blocks):
    return stage_fn(p, x + 0.5 * jnp.roll(x, x.shape[-2] // blocks, axis=-2))


def embed_fn(ep, raw):
    return jnp.tanh(raw @ ep["embed"])


def loss_fn(lp, y, target):
    return jnp.sum((y @ lp["head"] - target) ** 2)


def init(chunks: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    chunk = {
        "fc1": {"kernel": normal(chunks, D, F) / np.sqrt(D), "bias": 0.1 * normal(chunks, F)},
        "fc2": {"kernel": normal(chunks, F, D) / np.sqrt(F), "bias": 0.1 * normal(chunks, D)},
    }
    return chunk, {"embed": normal(D_IN, D) / np.sqrt(D_IN)}, {"head": normal(D, D_OUT)}


def reference(chunk_params, embed_params, loss_params, x, targets, ring=0):
    """Σ over microbatches of the loss through every chunk in order, unsharded (``ring``: the
    ring chunk's roll over that many token blocks)."""
    chunks = jax.tree.leaves(chunk_params)[0].shape[0]
    chunk_fn = functools.partial(ring_reference_fn, blocks=ring) if ring else stage_fn

    def one(xm, tm):
        xm = embed_fn(embed_params, xm)
        for c in range(chunks):
            xm = chunk_fn(jax.tree.map(lambda a, c=c: a[c], chunk_params), xm)
        return loss_fn(loss_params, xm, tm)

    return sum(one(x[m], targets[m]) for m in range(x.shape[0]))


def device_order(schedule: sc.Schedule) -> np.ndarray:
    """Chunk indices in the order ``P("stage")`` lays them out: device s holds s, s+S, ...
    (ZBV: s and 2S − 1 − s)."""
    S, V = schedule.stages, schedule.virtual
    return np.array([schedule.chunk(s, v) for s in range(S) for v in range(V)])


@functools.cache
def compiled(name: str, data: int, stages: int, model: int, micro: int, virtual: int,
             poison: bool = False, ring: bool = False, uniform: bool | None = None,
             phased: bool = False):  # fmt: skip
    """The jitted step: (chunks, embed, head, x, targets) -> (loss, grads, embed and head grads).

    ``ring``: the chunk is ``ring_stage_fn`` over model (tokens split there, no TP);
    ``phased``: the schedule in the phased form (``schedules.phased``)."""
    mesh = mesh_of(data, stages, model)
    schedule = sc.build(name, stages, micro, virtual)
    schedule = sc.phased(schedule) if phased else schedule
    tp = "model" if model > 1 and not ring else None
    # Hidden dims over model; a size-1 axis splits nothing and appears in no spec.
    m = tp
    chunk_spec = {
        "fc1": {"kernel": P("stage", None, m), "bias": P("stage", m)},
        "fc2": {"kernel": P("stage", m, None), "bias": P("stage", None)},
    }
    # [M, B, T, ...]: microbatch rows split over data (ring: tokens over model)
    batch = P(None, "data", "model" if ring else None)
    chunk_fn = ring_stage_fn if ring else functools.partial(stage_fn, axis=tp)

    def body(chunks, embed, head, x, targets):
        ends = pl.Ends(embed_fn, embed, loss_fn, head)
        loss, grads, embed_grads, head_grads = pl.pipeline_grads(
            schedule, chunk_fn, chunks, ends, x, targets, poison=poison, uniform=uniform
        )
        # Data-parallel sync of the partial sums, once, after the pipeline (ring: and over
        # the token blocks).
        sync = ("data", "model") if ring else "data"
        return jax.lax.psum((loss, grads, embed_grads, head_grads), sync)

    out_specs = (P(), chunk_spec, P(), P())
    step = jax.shard_map(body, mesh=mesh, in_specs=(chunk_spec, P(), P(), batch, batch),
                         out_specs=out_specs)  # fmt: skip
    return jax.jit(step)


def run(name, data, stages, model, micro, virtual=1, poison=False, seed=0, ring=False,
        uniform=None, phased=False):  # fmt: skip
    """(pipeline results, reference results), the chunks in reference order."""
    schedule = sc.build(name, stages, micro, virtual)
    virtual = schedule.virtual  # ZBV: 2
    chunks, embed, head = init(stages * virtual, seed)
    rng = np.random.default_rng(seed + 1)
    tokens = T * model if ring else T
    x = jnp.asarray(rng.normal(size=(micro, B * data, tokens, D_IN)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(micro, B * data, tokens, D_OUT)), jnp.float32)
    order = device_order(schedule)
    step = compiled(name, data, stages, model, micro, virtual, poison, ring, uniform, phased)
    loss, grads, embed_grads, head_grads = step(
        jax.tree.map(lambda a: a[order], chunks), embed, head, x, t
    )
    grads = jax.tree.map(lambda a: a[np.argsort(order)], grads)
    ref = functools.partial(reference, ring=model if ring else 0)
    want_loss, want = jax.value_and_grad(ref, argnums=(0, 1, 2))(chunks, embed, head, x, t)
    return (loss, grads, embed_grads, head_grads), (want_loss, *want)


@st.composite
def pipelines(draw):
    name = draw(st.sampled_from(sc.SCHEDULES))
    stages = draw(st.integers(1, 4))
    data, model = draw(st.sampled_from([(1, 1), (2, 1), (1, 2)]))
    if data * stages * model > 8:
        data = model = 1
    virtual = draw(st.integers(1, 2)) if name == "interleaved" else 1
    low = stages if name in ("zb", "zbv") else 1
    micro = draw(st.integers(low, low + 3))
    if name == "interleaved":
        micro = stages * draw(st.integers(1, 2))
    return name, data, stages, model, micro, virtual


@given(pipelines(), st.booleans())
@example(("gpipe", 2, 4, 1, 3, 1), False)  # M not a multiple of S
@example(("1f1b", 1, 4, 2, 6, 1), False)  # TP inside each stage
@example(("1f1b", 1, 4, 2, 6, 1), True)  # the phased form, TP inside
@example(("interleaved", 1, 2, 2, 4, 2), True)
@example(("zb", 2, 3, 1, 5, 1), False)
@example(("zb", 2, 3, 1, 5, 1), True)
@example(("zbv", 2, 2, 2, 3, 1), False)  # the V: chunks s and 2S−1−s on stage s, TP inside
@example(("zbv", 1, 4, 1, 4, 1), True)  # S > 2: two permutes each way
def test_pipeline_equals_the_unsharded_loop(case, phased):
    """Branch form or phased form (``schedules.phased``), the same loss and gradients."""
    got, want = run(*case, phased=phased)
    names = ("loss", "chunk grads", "embedding grads", "head grads")
    for name, a, b in zip(names, got, want, strict=True):
        assert testing.max_error(a, b) <= 1e-5, (name, case, phased)


FORMS = [(name, False) for name in sc.SCHEDULES] + [
    (name, True) for name in sc.SCHEDULES if name != "gpipe"
]  # GPipe's phased form is its branch form


@pytest.mark.parametrize(("name", "phased"), FORMS)
def test_nan_poisoned_buffers_change_nothing(name, phased):
    """Every buffer starts at NaN: a read of any slot the schedule did not write would carry
    NaN into the gradients. They stay finite and equal to the zero-started run, bitwise."""
    case = (name, 1, 4, 1, 8, 2 if name == "interleaved" else 1)
    poisoned, _ = run(*case, poison=True, phased=phased)
    clean, _ = run(*case, phased=phased)
    for a, b in zip(jax.tree.leaves(poisoned), jax.tree.leaves(clean), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def step_args(stages: int, micro: int, virtual: int = 1) -> tuple:
    chunks, embed, head = init(stages * virtual)
    return chunks, embed, head, jnp.zeros((micro, B, T, D_IN)), jnp.zeros((micro, B, T, D_OUT))


@functools.cache
def compiled_step(name: str, stages: int, micro: int):
    virtual = sc.build(name, stages, micro).virtual  # ZBV: 2
    args = step_args(stages, micro, virtual)
    return compiled(name, 1, stages, 1, micro, virtual).lower(*args).compile()


def temp_bytes(name: str, stages: int, micro: int) -> int:
    return compiled_step(name, stages, micro).memory_analysis().temp_size_in_bytes


def busiest_stage_flops(name: str, stages: int, micro: int) -> float:
    """Matmul FLOPs of the busiest stage, read from the compiled step (``Ledger.flops``, each
    branch counted by the ticks the stage spends in it)."""
    led = ledger.ledger_of(compiled_step(name, stages, micro), mesh_of(1, stages, 1))
    sched = sc.build(name, stages, micro)
    return max(stage_ledger(led, sched, s).flops for s in range(stages))


def test_zero_bubble_runs_the_matmuls_of_one_f_one_b():
    """ZB-H1's W computes only weight gradients from what B stashed: its compiled step runs
    1F1B's matmuls (the old W re-ran the input-gradient chain: 1.09x here), and the count is a
    real one: it doubles with M."""
    flops = {(name, m): busiest_stage_flops(name, 4, m) for name in ("1f1b", "zb") for m in (8, 32)}
    assert flops[("zb", 8)] <= 1.02 * flops[("1f1b", 8)], flops
    assert flops[("zb", 32)] <= 1.02 * flops[("1f1b", 32)], flops
    assert flops[("1f1b", 32)] == pytest.approx(4 * flops[("1f1b", 8)], rel=0.05), flops


def test_stash_grows_with_m_for_gpipe_only():
    """memory_analysis temp bytes at S=4, M = 8 and 32: GPipe's stash has M slots, so each
    extra microbatch adds its residuals (at least x and the hidden layer); 1F1B's and ZB-H1's
    have S slots whatever M is: an extra microbatch adds less than half an activation (the
    schedule tables' rows), so nothing per microbatch is kept."""
    act, hidden = B * T * D * 4, B * T * F * 4
    per_micro = {
        name: (temp_bytes(name, 4, 32) - temp_bytes(name, 4, 8)) / 24
        for name in ("gpipe", "1f1b", "zb")
    }
    assert per_micro["gpipe"] >= act + hidden, per_micro
    assert per_micro["1f1b"] < act / 2 and per_micro["zb"] < act / 2, per_micro


def tick_loop_copies(hlo: str) -> list[list[tuple[int, ...]]]:
    """Per compiled loop with a conditional in its body (a segment's ticks), the shapes of the
    arrays its body copies each iteration."""
    bodies = {}
    for comp in re.split(r"\n\n", hlo):
        name = re.match(r"\s*(?:ENTRY )?(%[\w.\-]+)", comp)
        if name:
            bodies[name.group(1)] = comp
    out = []
    for body in (bodies[b] for b in re.findall(r" while\(.*?body=(%[\w.\-]+)", hlo)):
        if " conditional(" in body:
            shapes = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", body)
            out.append([tuple(int(d) for d in s.split(",") if d) for s in shapes])
    return out


@pytest.mark.parametrize(("name", "phased"), FORMS)
def test_no_buffer_is_copied_whole_each_tick(name, phased):
    """A branch returns its writes instead of the updated buffers (engine ``_apply``): had the
    stash, the inboxes and the gradients gone through the ``lax.switch``, XLA would copy each
    whole every tick (10–58 activations per tick here, measured). Each tick loop copies at
    most 4 activations per phase (what arrives and what is sent; a phased super tick runs 2
    or 3 phases), and of a buffer [slots, ...] at most one slot, never the whole."""
    virtual = 2 if name in ("interleaved", "zbv") else 1
    step = compiled(name, 1, 2, 1, 8, virtual, phased=phased)
    schedule = sc.build(name, 2, 8, virtual)
    period = (sc.phased(schedule) if phased else schedule).period
    loops = tick_loop_copies(step.lower(*step_args(2, 8, virtual)).compile().as_text())
    assert loops
    for shapes in loops:
        assert sum(int(np.prod(s)) for s in shapes) <= 4 * period * B * T * D, shapes
        assert all(s[0] == 1 for s in shapes if len(s) == 4), shapes  # [slots, B, T, D]


def test_ticks_send_one_activation_each_way():
    """The compiled 1F1B step: per tick of a sending segment one collective-permute of one
    microbatch activation [B, T, D] per direction; the ticks and segments from the table."""
    stages, micro = 4, 8
    schedule = sc.one_f_one_b(stages, micro)
    tab = pl.tables(schedule)
    step = compiled("1f1b", 1, stages, 1, micro, 1)
    led = ledger.measure(step, *step_args(stages, micro), mesh=mesh_of(1, stages, 1))
    permutes = led.summary()[("collective-permute", ("stage",))]
    sends = int(tab.sends_x.sum() + tab.sends_dy.sum())
    segment_ticks = sum((stop - start) * (sx + sd) for start, stop, sx, sd in tab.segments())
    assert permutes.count == segment_ticks == sum(tab.sent())
    assert permutes.bytes_sent == segment_ticks * B * T * D * 4
    assert sends <= segment_ticks


@pytest.mark.parametrize("phased", [False, True])
def test_zbv_sends_each_value_over_the_one_permute_that_carries_it(phased):
    """ZBV above S = 2 sends down its V and up it: two permutations. A tick runs only the
    permutes that carry a value (a switch on the tick's bitmask, ``pipeline.sends``), so the
    permutes each stage runs equal ``Tables.sent()``, under 0.6× the two per tick of every
    sending segment that sending both would take."""
    stages, micro = 4, 8
    schedule = sc.zbv(stages, micro)
    schedule = sc.phased(schedule) if phased else schedule
    tab = pl.tables(schedule)
    step = compiled("zbv", 1, stages, 1, micro, 2, phased=phased)
    led = ledger.measure(step, *step_args(stages, micro, 2), mesh=mesh_of(1, stages, 1))
    x, dy = tab.sent()
    both = sum((b - a) * 2 * (sx + sd) for a, b, sx, sd in tab.segments())
    assert x + dy < 0.6 * both, (x, dy, both)
    for s in range(stages):
        permutes = stage_ledger(led, schedule, s).summary()[("collective-permute", ("stage",))]
        assert (permutes.count, permutes.bytes_sent) == (x + dy, (x + dy) * B * T * D * 4), s


@pytest.mark.parametrize("name", sc.SCHEDULES)
def test_segments_stay_few_whatever_m(name):
    """The steady state is one segment (S = 2: 1F1B alternates F and B every tick), so the
    program does not grow with M (a few segments; ZBV's cool-down alternates B and W ticks
    and its turn sends nothing: 8 at S = 2); segments tile the ticks and cover every tick
    that sends."""
    counts = {}
    for micro in (2, 8, 16):
        schedule = sc.build(name, 2, micro, 2 if name == "interleaved" else 1)
        tab = pl.tables(schedule)
        segments = tab.segments()
        counts[micro] = len(segments)
        assert len(segments) <= (8 if name == "zbv" else 5), (micro, segments)
        assert [s[0] for s in segments[1:]] == [s[1] for s in segments[:-1]]
        assert segments[0][0] == 0 and segments[-1][1] == schedule.ticks
        for start, stop, sx, sd in segments:
            assert sx or not tab.sends_x[start:stop].any()
            assert sd or not tab.sends_dy[start:stop].any()
    assert counts[8] == counts[16], counts


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(micro=3), r"inputs leaf needs a leading dim of 4 microbatches \(M\), got shape \[3,"),
        (dict(virtual=2), r"stage_params leaf needs a leading dim of 1 chunks per device \(V\)"),
        (dict(stages=4), "The schedule has 4 stages but the 'stage' axis has 2 devices"),
    ],
)
def test_shapes_that_do_not_fit_the_schedule_are_one_sentence(change, match):
    """A wrong microbatch or chunk count would be clamped by the indexing, not caught: refused
    before tracing the loop."""
    sizes = dict(stages=2, micro=4, virtual=1) | change
    schedule = sc.one_f_one_b(sizes["stages"], 4)
    chunks, embed, head = init(2 * sizes["virtual"])
    x = jnp.zeros((sizes["micro"], B, T, D_IN))
    t = jnp.zeros((sizes["micro"], B, T, D_OUT))
    mesh = mesh_of(1, 2, 1)

    def body(chunks, x, t):
        ends = pl.Ends(embed_fn, embed, loss_fn, head)
        return pl.pipeline_grads(schedule, stage_fn, chunks, ends, x, t)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=P())
    with pytest.raises(ValueError, match=match) as err:
        jax.jit(fn).lower(chunks, x, t)
    assert str(err.value).count(". ") == 0


# ----------------------------------------------------------------------------- uniform form


@given(pipelines())
@example(("1f1b", 1, 2, 2, 4, 1))
@example(("interleaved", 1, 2, 2, 4, 2))
@example(("zb", 2, 2, 2, 3, 1))
@example(("zbv", 1, 2, 2, 2, 1))
@example(("gpipe", 1, 1, 1, 1, 1))  # one stage: no stage permute at all
def test_a_ppermute_inside_a_chunk_runs_in_the_uniform_form(case):
    """A chunk that ppermutes over model (tokens split there) under every schedule: the engine
    picks the uniform form (each phase on every stage, masked), and the loss and every
    gradient equal the unsharded loop's."""
    name, data, stages, _, micro, virtual = case
    data = 1 if data * stages * 2 > 8 else data
    got, want = run(name, data, stages, 2, micro, virtual, ring=True)
    names = ("loss", "chunk grads", "embedding grads", "head grads")
    for what, a, b in zip(names, got, want, strict=True):
        assert testing.max_error(a, b) <= 1e-5, (what, case)


@pytest.mark.parametrize("name", sc.SCHEDULES)
def test_masked_phases_never_reach_a_result(name):
    """Uniform form, buffers poisoned with NaN: a stage computes every phase some stage runs,
    on whatever its slot 0 holds where it has no action of its own; those results are masked
    out, so the gradients stay finite and equal the zero-started run's, bitwise."""
    case = (name, 1, 2, 2, 4, 2 if name == "interleaved" else 1)
    poisoned, _ = run(*case, poison=True, ring=True)
    clean, _ = run(*case, ring=True)
    for a, b in zip(jax.tree.leaves(poisoned), jax.tree.leaves(clean), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_uniform_form_runs_any_chunk():
    """Asked for, the uniform form runs a chunk without a ppermute too (TP inside) and equals
    the loop; the branch form asked to run a ppermute is refused in one sentence."""
    got, want = run("1f1b", 1, 2, 2, 4, uniform=True)
    for a, b in zip(got, want, strict=True):
        assert testing.max_error(a, b) <= 1e-5
    with pytest.raises(ValueError, match="runs a ppermute over 'model', which the branch") as err:
        run("1f1b", 1, 2, 2, 4, ring=True, uniform=False)
    assert str(err.value).count(". ") == 0


def test_every_device_runs_each_phase_some_stage_runs():
    """The compiled uniform step, per stage (``stage_ledger``, each variant counted by the super
    ticks that run it): the chunk's permute over model once per F phase and once per B phase
    (its transpose) that some stage runs (``chunk_runs``), the same on every stage, and the
    stage permutes one per sending super tick and direction."""
    stages, micro = 2, 4
    schedule = sc.uniform(sc.one_f_one_b(stages, micro))
    step = compiled("1f1b", 1, stages, 2, micro, 1, ring=True)
    chunks, embed, head = init(stages)
    x, t = jnp.zeros((micro, B, 2 * T, D_IN)), jnp.zeros((micro, B, 2 * T, D_OUT))
    led = ledger.measure(step, chunks, embed, head, x, t, mesh=mesh_of(1, stages, 2))
    runs = pl.chunk_runs(schedule, 0)
    assert runs["F"] == runs["B"] == micro + stages - 1
    for s in range(stages):
        summary = stage_ledger(led, schedule, s).summary()
        assert summary[("collective-permute", ("model",))].count == runs["F"] + runs["B"]
        assert summary[("collective-permute", ("stage",))].count == sum(pl.tables(schedule).sent())


# ----------------------------------------------------------------------------- side inputs, aux


def gated_stage_fn(p, x, side):
    """A chunk that reads its microbatch's side input (a per-token gate on the residual) and
    returns an aux loss of its own (as a MoE layer's balance loss)."""
    (gate,) = side
    h = mlp_tp(x, p, None, jnp.tanh)
    return x + gate * h, 0.01 * jnp.sum(h**2)


@pytest.mark.parametrize("name", ["1f1b", "zb", "zbv"])
def test_side_inputs_and_aux_losses(name):
    """``side``: per-microbatch inputs every chunk reads (packed documents' segment ids), on
    every stage; ``aux``: each chunk's own loss term, summed into the loss, its gradient
    through B (and, split, W). A plain, a split and a V schedule, buffers NaN-poisoned: the
    loss and every gradient equal the unsharded loop's."""
    schedule = sc.build(name, 2, 4, 2 if name == "interleaved" else 1)
    chunks, embed, head = init(2 * schedule.virtual)
    rng = np.random.default_rng(1)
    x, t = (jnp.asarray(rng.normal(size=(4, B, T, d)), jnp.float32) for d in (D_IN, D_OUT))
    gate = jnp.asarray(rng.integers(0, 3, size=(4, B, T, 1)), jnp.float32)

    def body(chunks, embed, head, x, t, gate):
        ends = pl.Ends(embed_fn, embed, loss_fn, head)
        return pl.pipeline_grads(schedule, gated_stage_fn, chunks, ends, x, t, side=(gate,),
                                 aux=True, poison=True)  # fmt: skip

    chunk_spec = jax.tree.map(lambda _: P("stage"), chunks)
    step = jax.jit(jax.shard_map(body, mesh=mesh_of(1, 2, 1), in_specs=(chunk_spec, *[P()] * 5),
                                 out_specs=(P(), chunk_spec, P(), P())))  # fmt: skip
    order = device_order(schedule)
    got = step(jax.tree.map(lambda a: a[order], chunks), embed, head, x, t, gate)
    got = (got[0], jax.tree.map(lambda a: a[np.argsort(order)], got[1]), *got[2:])

    def ref(chunks, embed, head):
        def one(m):
            h, aux = embed_fn(embed, x[m]), 0.0
            for c in range(2 * schedule.virtual):
                h, a = gated_stage_fn(jax.tree.map(lambda a, c=c: a[c], chunks), h, (gate[m],))
                aux = aux + a
            return loss_fn(head, h, t[m]) + aux

        return sum(one(m) for m in range(4))

    want = (ref(chunks, embed, head), *jax.grad(ref, argnums=(0, 1, 2))(chunks, embed, head))
    for what, a, b in zip(("loss", "chunks", "embed", "head"), got, want, strict=True):
        assert testing.max_error(a, b) <= 1e-5, what


def test_aux_without_an_aux_loss_is_one_sentence():
    schedule = sc.build("1f1b", 2, 2)
    chunks, embed, head = init(2)
    x, t = jnp.zeros((2, B, T, D_IN)), jnp.zeros((2, B, T, D_OUT))

    def body(chunks, x, t):
        ends = pl.Ends(embed_fn, embed, loss_fn, head)
        return pl.pipeline_grads(schedule, stage_fn, chunks, ends, x, t, aux=True)[0]

    fn = jax.shard_map(body, mesh=mesh_of(1, 2, 1), in_specs=(P("stage"), P(), P()),
                       out_specs=P())  # fmt: skip
    with pytest.raises(ValueError, match=r"stage_fn must return \(y, aux_loss\[, metrics\]\)"):
        jax.jit(fn).lower(chunks, x, t)
