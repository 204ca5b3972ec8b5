"""The ViT's parameter terms: gradient sync (DP), FSDP gathers and scatters, ZeRO-1/2, the
token-row gathers and the clip norm (notation: ``models.vit.cost``).

``param_leaves`` lists every leaf of ``vit_ref.init(cfg)`` with its split under the plan (no
arrays), ``sync_axes`` the axes its gradient is a partial sum over; each ``*_terms`` function
states its formula and why it is the minimum.
"""

from __future__ import annotations

import dataclasses
import math

import jax

import vit_ref
from shardkit.comm.bytes import all_gather_bytes, all_reduce_bytes, permute_bytes
from shardkit.comm.ledger import exchange
from shardkit.comm.terms import Term
from shardkit.models.vit.geometry import STEP_END, WORD, Axes, Geometry, term
from shardkit.models.vit.plan import param_axes, row_leaves, stacked
from shardkit.parallel.tiles import LANES, bucket_elements


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One param leaf as the plan places it.

    Attributes:
      path: keys from the root, e.g. ("blocks", "mlp", "fc1", "kernel").
      shape: the full shape (blocks stacked along a leading l axis).
      split: mesh axes that split it (``heads``, ``mlp`` -> model; ``embed`` -> data under
        ZeRO: the params themselves under ZeRO-3, their optimizer state and synced gradients
        under ZeRO-1/2).
      local: elements on one device (of the state under ZeRO-1/2).
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    split: Axes
    local: int

    @property
    def in_blocks(self) -> bool:
        return self.path[0] == "blocks"


def param_leaves(g: Geometry) -> list[Leaf]:
    """Every param leaf of ``vit_ref.init(cfg)`` with its split under ``g.plan`` (no arrays)."""
    rules = {"heads": "model", "mlp": "model"}
    if g.plan.zero:  # ZeRO-1/2: the state and gradients; ZeRO-3: the params too
        rules["embed"] = "data"
    if g.plan.pp != "none":
        rules["layers"] = "stage"
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), g.cfg))
    stack = param_axes(g.cfg, stacked(g.plan))  # the stack's leaves: per-layer ones sum to them
    names = jax.tree.leaves(stack, is_leaf=lambda x: isinstance(x, tuple))
    leaves = []
    for (path, shape), logical in zip(
        jax.tree_util.tree_leaves_with_path(shapes), names, strict=True
    ):
        axes = [rules.get(name) if name else None for name in logical]
        split = tuple(a for a in axes if a is not None and g.sizes[a] > 1)
        local = math.prod(
            d // (g.sizes[a] if a in split else 1) for d, a in zip(shape.shape, axes, strict=True)
        )
        leaves.append(Leaf(tuple(str(k.key) for k in path), tuple(shape.shape), split, local))
    return leaves


def sync_axes(g: Geometry, leaf: Leaf) -> Axes:
    """The axes a leaf's gradient is a partial sum over, all-reduced at the step's end.

    ``data``: every device of the data axis saw a different batch shard (FSDP-split leaves are
    reduce-scattered instead: the transpose of their all-gather). The token axes: every leaf
    but the head acts on token shards (the head sees pooled features, already summed over
    them); a leaf split over a token axis (Megatron-SP's model-split weights) is complete there.
    """
    axes = [] if "data" in leaf.split else ["data"]
    if leaf.path[0] != "head":
        axes += [a for a in g.token_axes if a not in leaf.split]
    return g.order(axes)


def gradient_terms(g: Geometry) -> list[Term]:
    """Gradient sync: ``dw{U_axes} --AllReduce--> dw``, one bucket per group of leaves.

    A bucket holds the leaves that share (sync axes, varying axes, dtype) — the varying axes
    being the sync axes plus the axes that split the leaf, so model-split and model-replicated
    leaves never share a flat buffer — concatenated and reduced once: 2(n−1)/n · P_bucket·w
    with P_bucket the LOCAL elements (w: ``g.grad_word``, 2 under bf16 gradient sync off the
    CPU; the loss then travels apart, in float32). Each element must cross the group once in
    each ring phase, so no scheme sends fewer bytes. At the step's end all buckets over the
    same axes, and the loss over data, are independent, and XLA's all-reduce combiner runs
    them as ONE op.
    The token-indexed leaves (``_row_terms``) are not partial sums over the token axes: only
    their own rows' slice joins the buckets (over data).
    """
    rows = token_row_leaves(g)
    buckets: dict[tuple[Axes, frozenset[str]], int] = {}
    for leaf in param_leaves(g):
        if leaf.in_blocks and g.plan.syncs_by_layer:
            continue  # all-reduced layer by layer (``layer_sync_terms``)
        axes = sync_axes(g, leaf)
        size = leaf.local
        if leaf.path[0] in rows:
            axes = tuple(a for a in axes if a not in g.token_axes)
            size = size // leaf.shape[1] * g.t  # this shard's rows (cls and patches alike)
            if leaf.path[0] == "cls":
                continue  # one slice of [cls; pos_embedding] rows: counted with the patches
        if axes:
            varying = frozenset(axes) | frozenset(leaf.split)
            if leaf.path[0] in rows:
                varying |= frozenset(g.token_axes)
            buckets[(axes, varying)] = buckets.get((axes, varying), 0) + size
    terms = []
    for (axes, varying), size in buckets.items():
        what = f"gradient bucket of {size:,} elements varying over {','.join(sorted(varying))}"
        each = all_reduce_bytes(size * g.grad_word, g.n(axes))
        terms.append(Term("all-reduce", axes, 1, each, what, STEP_END, fused=STEP_END))
    return [*terms, *row_terms(g), *layer_sync_terms(g)]


def layer_sync_terms(g: Geometry) -> list[Term]:
    """DP's overlapped gradient sync (``Plan.syncs_by_layer``): in each of the l layers' backward
    steps, each bucket of one layer's gradients (the block leaves sharing sync axes and
    varying axes, as at the step's end) is laid out as [n, r, 128] (padded to n·r·128) and
    reduced by a reduce-scatter of permutes (``permuted_scatter_terms``), each device keeping
    r·128 elements, then an all-gather of them: 2(n−1)/n · the padded bucket, an
    all-reduce's bytes. Elements travel
    in ``grad_sync``'s dtype (``g.grad_word``: XLA:CPU widens these bf16 collectives too)."""
    if not g.plan.syncs_by_layer:
        return []
    word = g.grad_word
    buckets: dict[tuple[Axes, frozenset[str]], int] = {}
    for leaf in param_leaves(g):
        axes = sync_axes(g, leaf)
        if leaf.in_blocks and axes:
            key = (axes, frozenset(axes) | frozenset(leaf.split))
            buckets[key] = buckets.get(key, 0) + leaf.local // g.cfg.depth
    terms: list[Term] = []
    for (axes, varying), size in buckets.items():
        what = f"one layer's gradient bucket of {size:,} elements over {','.join(sorted(varying))}"
        terms += permuted_all_reduce_terms(
            g, axes, g.cfg.depth, size, word, what, "reduce-scattered under the next layer's "
            "backward", "backward",
        )  # fmt: skip
    return terms


def permuted_all_reduce_terms(
    g: Geometry, axes: Axes, runs: int, size: int, word: int, what: str, hops: str, phase: str
) -> list[Term]:
    """``runs`` all-reduces of ``overlap.all_reduce_permuted`` over ``axes`` (n devices) of
    ``size`` elements of ``word`` bytes: laid out as [n, r, 128] (padded to n·r·128), a
    reduce-scatter of permutes (``permuted_scatter_terms``; ``hops`` says where they run),
    each device keeping r·128 elements, then an all-gather of them: 2(n−1)/n · the padded
    size, an all-reduce's bytes."""
    n = g.n(axes)
    chunk = -(-size // (n * LANES)) * LANES  # r·128 elements: one device's share
    return [
        *permuted_scatter_terms(g, axes, runs, chunk * word, f"{what}: {hops}", phase),
        *term(g, "all-gather", axes, runs, all_gather_bytes(n * chunk * word, n),
              f"{what}: the summed shares gathered", phase),
    ]  # fmt: skip


def permuted_scatter_terms(
    g: Geometry, axes: Axes, runs: int, share: float, what: str, phase: str
) -> list[Term]:
    """``runs`` reduce-scatters of ``overlap.scatter_by_permutes`` over ``axes`` (n devices),
    each leaving every device one ``share`` of bytes: recursive halving when n is a power of
    two, an exchange of d shares with device i XOR d for d = n/2, …, 1 (the ledger books each
    on the one axis whose coordinate it flips, linear index major first); else a ring, n − 1
    permutes of one share (i → i + 1). Both send (n − 1) shares, a reduce-scatter's bytes."""
    axes = g.order(axes)
    n = g.n(axes)
    if n & (n - 1):
        return term(g, "collective-permute", axes, runs * (n - 1), share, what, phase, step=1)
    terms, d = [], n // 2
    while d:
        inner = 1  # devices per step of the axes after this one
        for axis in reversed(axes):
            if d < inner * g.sizes[axis]:
                break
            inner *= g.sizes[axis]
        pattern = exchange(d // inner, g.sizes[axis])
        terms += term(g, "collective-permute", [axis], runs, permute_bytes(d * share),
                      f"{what} (exchange {d})", phase, pattern=pattern)  # fmt: skip
        d //= 2
    return terms


def token_row_leaves(g: Geometry) -> tuple[str, ...]:
    """``vit.row_leaves`` when tokens are split, else ()."""
    return row_leaves(g.cfg) if g.token_axes else ()


def row_terms(g: Geometry) -> list[Term]:
    """The token-indexed gradients (``vit.row_leaves``: the learned position embedding and
    the class token) over the token axes: ``rows[T'_S, d] --AllGather--> rows[T', d]``.

    Each token shard's forward touched only its own t rows, so the shards' gradients are
    disjoint row slices, not partial sums: the sum is the concatenation, and each device needs
    the T' − t rows it lacks, (n−1)/n·T'·d·w (T' = T padded; the padded rows are zeros) — the
    minimum, against the all-reduce's 2(n−1)/n·T·d·w. One op after the step-end buckets.
    """
    rows = token_row_leaves(g)
    if not rows:
        return []
    pos = next(leaf for leaf in param_leaves(g) if leaf.path[0] == "pos_embedding")
    width = pos.local // pos.shape[1]  # d, or d/n_data where ZeRO splits it
    whole = g.padded_tokens * width * WORD
    what = f"{' and '.join(rows)} gradient rows of each token shard"
    return term(g, "all-gather", g.token_axes, 1, all_gather_bytes(whole, g.shards), what,
                 STEP_END)  # fmt: skip


def fsdp_terms(g: Geometry) -> list[Term]:
    """FSDP (ZeRO-3) over data: ``w[d_data] --AllGather--> w[d]`` just before use, in buckets.

    ``data.fsdp_gather`` moves the split leaves as one flat buffer per bucket — the leaves
    sharing their varying axes (``fsdp_buckets``: with TP the model-split fragments and the
    model-replicated leaves; with tokens split, the head, which sees pooled features, apart
    from the leaves used on token shards) — so a bucket is ONE all-gather however many leaves
    it holds. Autodiff transposes
    each into ONE reduce-scatter of the bucket's gradients, so gradients arrive split, with no
    all-reduce. Block leaves are gathered inside the layer loop (l times, one layer's slice
    each); the gathered weights are kept for backward. With P_F the FSDP-split elements per
    device BEFORE the split (still model-split):
      forward AG (n−1)/n·P_F·w;  backward RS (n−1)/n·P_F·w;  ops: buckets (× l in the loop)
    remat: backward re-runs each block's forward and gathers its buckets again (a bucket is
    gathered whole: its leaves are read together), + (n−1)/n·P_blocks·w, ≈ 3(n−1)/n·P·w.
    """
    if g.plan.zero != 3:
        return []
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    outer = [leaf for leaf in leaves if not leaf.in_blocks]
    blocks = [leaf for leaf in leaves if leaf.in_blocks]
    layers = g.cfg.depth
    return [
        *fsdp_group(g, "all-gather", outer, 1, "embedding, norms, head", "forward"),
        *fsdp_group(g, "reduce-scatter", outer, 1, "their gradients", "backward"),
        *fsdp_group(g, "all-gather", blocks, layers, "block weights, per layer", "forward"),
        *fsdp_group(
            g, "reduce-scatter", blocks, layers, "their gradients", "backward", bool(g.plan.overlap)
        ),
        *fsdp_group(
            g, "all-gather", blocks * g.plan.recompute, layers, "block weights", "recompute"
        ),
    ]


def zero_terms(g: Geometry) -> list[Term]:
    """ZeRO-1 / ZeRO-2 over data (``plan.zero``): params replicated, state split.

    Every embed-split leaf's gradient ``dw[D]{U_data} --ReduceScatter--> dw[D_data]``: a device
    updates only its slice, so it needs only that slice's sum; then
    ``w[D_data] --AllGather--> w[D]``: every device needs every param for the next forward.
    (n−1)/n·P·w each, 2(n−1)/n·P·w together, one all-reduce's bytes: the minimum for a
    replicated param trained on split data. Leaves with no embed dim (biases over mlp or
    classes) stay in the all-reduce buckets (``_gradient_terms``).
    Ops: the reduce-scatters run in the gradients' buckets (``data.zero_scatter``, keyed like
    FSDP's by the varying axes: model-split or not, token-reduced or not); ZeRO-1 runs each
    once, after backward; ZeRO-2 runs the blocks' inside the layer loop, once per layer, in
    that layer's backward step (the outer leaves' once), so no layer's whole gradient outlives
    its step; with ``overlap`` as permutes, one layer behind (``fsdp_group``'s ``permuted``:
    the same bytes). The all-gathers after the update: one per set of split axes (the updated slices
    vary over data and the axes that split the param, nothing else). XLA's CPU pipeline
    combines neither. On a TPU every bucket travels as padded tiles (``fsdp_group``).
    """
    if g.plan.zero not in (1, 2):
        return []
    n = g.plan.size("data")
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    outer = [leaf for leaf in leaves if not leaf.in_blocks]
    blocks = [leaf for leaf in leaves if leaf.in_blocks]
    if g.plan.zero == 1:
        scatters = fsdp_group(g, "reduce-scatter", leaves, 1, "gradient slices", STEP_END)
    else:
        scatters = [
            *fsdp_group(g, "reduce-scatter", outer, 1, "outer gradient slices", "backward"),
            *fsdp_group(
                g, "reduce-scatter", blocks, g.cfg.depth, "block gradient slices, per layer",
                "backward", bool(g.plan.overlap),
            ),
        ]  # fmt: skip
    by_split: dict[frozenset[str], int] = {}
    for leaf in leaves:
        by_split[frozenset(leaf.split)] = by_split.get(frozenset(leaf.split), 0) + leaf.local
    sizes = [bucket_elements(size, g.fsdp_tiles) for size in by_split.values()]
    gathered = all_gather_bytes(sum(sizes) * n * WORD, n)
    count = len(sizes)
    gathers = term(g, "all-gather", ["data"], count, gathered / count, "updated params", STEP_END)
    return [*scatters, *gathers]


def fsdp_buckets(g: Geometry, leaves: list[Leaf]) -> list[list[Leaf]]:
    """The flat buffers ``data.fsdp_gather`` makes of ``leaves``: one per set of varying axes
    of the fragments (the axes that split a leaf, plus the token axes it is cast to vary over
    because its gradient is a partial sum there; every ViT param is float32)."""
    buckets: dict[frozenset[str], list[Leaf]] = {}
    for leaf in leaves:
        key = frozenset(leaf.split) | frozenset(sync_axes(g, leaf))
        buckets.setdefault(key, []).append(leaf)
    return list(buckets.values())


def fsdp_group(
    g: Geometry,
    kind: str,
    leaves: list[Leaf],
    runs: int,
    what: str,
    phase: str,
    permuted: bool = False,
) -> list[Term]:
    """One term for the buckets of ``leaves``, each gathered (or scattered) ``runs`` times.

    A leaf's ``local`` elements times n is its gathered size; block leaves hold all l layers,
    so a bucket's ``runs`` each move 1/runs of its elements: (n−1)/n · Σ local·n·w. FSDP's
    buckets and ZeRO's (``g.fsdp_tiles``: on a TPU) are padded to the tiles the TPU compiler
    keeps (``parallel.tiles``). ``permuted``: each reduce-scatter runs as permutes
    (``overlap.gather_permuted_back``, ``permuted_scatter_terms``), the same bytes.
    """
    n = g.plan.size("data")
    if not leaves:
        return []
    buckets = fsdp_buckets(g, leaves)
    sizes = [sum(leaf.local for leaf in bucket) // runs for bucket in buckets]
    sizes = [bucket_elements(size, g.fsdp_tiles) for size in sizes]
    count = len(buckets) * runs
    total = all_gather_bytes(sum(sizes) * runs * n * WORD, n)
    if permuted:
        share = sum(sizes) * WORD / len(buckets)  # each layer step: one bucket's share per device
        hidden = f"{what}: reduce-scattered under the next layer's backward"
        return permuted_scatter_terms(g, ("data",), count, share, hidden, phase)
    return term(g, kind, ["data"], count, total / count, what, phase)


def grad_norm_terms(g: Geometry) -> list[Term]:
    """Clipping's global gradient norm (``data.global_norm``): ONE all-reduce of one float32
    over every mesh axis, 2(n−1)/n·w. Each device adds the squares of its shards (each divided
    by the copies of it in the mesh), the psum the rest; fewer than one scalar per device
    cannot reach every device. It reads every synced gradient, so it follows the step-end
    all-reduces and is never combined with them."""
    axes = [a for a in g.mesh_axes if g.sizes[a] > 1]
    each = all_reduce_bytes(WORD, g.n(axes))
    return term(g, "all-reduce", axes, 1, each, "global gradient norm (clipping)", STEP_END)


def pipeline_fsdp_terms(g: Geometry) -> list[Term]:
    """FSDP under a pipeline: every FSDP-split leaf a device holds gathered once per step."""
    if g.plan.zero != 3:
        return []
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    return [
        *fsdp_group(g, "all-gather", leaves, 1, "this stage's layers and the ends", "forward"),
        *fsdp_group(g, "reduce-scatter", leaves, 1, "their gradients", "backward"),
    ]
