"""How FSDP's and ZeRO's buckets travel on a TPU: [r, 128] tiles whose row count the TPU
compiler keeps as a reduce-scatter.

The TPU compiler rewrites a bucket's all-gather and its transposed reduce-scatter into
all-reduces, twice the bytes, unless the bucket travels in a shape it keeps (docs/target.md;
``docs/measure/tpu_compiler_reduce_scatter.py``):

* an all-gather survives on whole [16, 128] tiles (a flat bucket only at multiples of 1,024);
* a reduce-scatter survives only for some row counts r = 16·k, and which depends on the slice
  and the layout. Measured with libtpu as of JAX 0.10.2, float32 and bf16 alike, on v5e:2x4:
  for a tiled [n·r, 128] operand exactly the k divisible by ⌈k / 152⌉ (every k up to 152,
  the even ones to 304, multiples of 3 to 456, ...: the compiler seems to cut the operand into
  ⌈k / 152⌉ equal pieces or give up); for the [n, r, 128] buckets travel as, the k divisible
  by the power of two ≥ ⌈k / 152⌉ (multiples of 4 from 305, of 8 from 609, ...). On v5e:4x8
  the cap is 50, not 152; v5e:2x2 follows another rule; the square slices (v5e:4x4, 8x8,
  16x16) keep none over a 1-D axis of every chip (even a bare ``psum_scatter`` becomes an
  all-reduce there), while v5e:2x8 keeps them.

A table of these rules would break with the next libtpu, so ``Tiles`` asks the compiler: for
a bucket of ``elements`` it compiles a probe (an all-gather of [r, 128] over the axis and its
gradient, the program's own pair) for candidate row counts in increasing order, the next few
after the fewest and then the fewest multiple of each power of two (where the rule above puts
them), within 1/16 of padding (8 tiles for small buckets), and keeps the first whose program
has a reduce-scatter and no all-reduce (ViT-L/16's ZeRO-1 bucket on v5e:2x4, 18,564 tiles at
the fewest, takes 18,688, a multiple of 128). Each answer is cached per mesh, axis, dtype and
size (a probe compiles in about 0.1 s; a ViT-B/16 FSDP bucket on v5e:2x4 finds 436 tiles,
0.9% padding, in 0.6 s). Where none keeps it, or the slice keeps no small one
either (the square slices), the bucket takes the fewest rows, costs an all-reduce on that
slice, and ``Tiles`` warns once. Off a TPU nothing is probed: the fewest rows. Every bucket is
tiled, the smallest padded to one tile (2,048 elements, 8 KiB of float32): below ~1,024
elements that is more than the all-reduce a flat bucket would become, but the program then
sends the collectives its plan names, on any size.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.mesh import platform

LANES, ROWS = 128, 16  # a tile: 16 rows of 128 lanes
TILE_ELEMENTS = LANES * ROWS
NEXT = 8  # consecutive tile counts tried after the fewest, before the power-of-two multiples
_KINDS = re.compile(r"\b(all-reduce|reduce-scatter)(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Buckets over ``mesh`` travel as [r, 128] tiles (``elements`` says how many per bucket).

    Attributes:
      mesh: the mesh the step runs on (its devices answer the probes: a TPU slice's, also
        under ``inspect --target``); None on paper (no compiler to ask): the fewest rows.
    """

    mesh: Mesh | None = None

    def elements(self, elements: int, axis: str = "data", dtype: jnp.dtype = jnp.float32) -> int:
        """The elements one device sends for a bucket of ``elements`` over ``axis``: whole
        tiles of the row count the compiler keeps (the fewest where nothing is asked: on
        paper, off a TPU, over one device)."""
        fewest = -(-elements // TILE_ELEMENTS)
        mesh = self.mesh
        if mesh is None or platform(mesh) != "tpu" or mesh.shape[axis] == 1:
            return fewest * TILE_ELEMENTS
        return _kept_tiles(self.mesh, axis, jnp.dtype(dtype).name, fewest) * TILE_ELEMENTS


def tiles_for(mesh: Mesh) -> Tiles | None:
    """How FSDP's and ZeRO's buckets travel on ``mesh``: as ``Tiles`` on a TPU mesh (a slice
    under ``--target`` too), flat (None) elsewhere."""
    return Tiles(mesh) if platform(mesh) == "tpu" else None


def bucket_elements(elements: int, tiles: Tiles | None = None) -> int:
    """The elements one device sends for an FSDP / ZeRO bucket of ``elements`` over ``data``:
    ``tiles.elements`` on a TPU mesh, else as they are."""
    return elements if tiles is None else tiles.elements(elements)


def wire(flat: jax.Array, tiles: Tiles | None, axis: str) -> jax.Array:
    """[Σ] -> the bucket's wire layout: [r, 128] zero padded (``Tiles.elements``), or flat."""
    if tiles is None:
        return flat
    size = tiles.elements(flat.size, axis, flat.dtype)
    return jnp.pad(flat, (0, size - flat.size)).reshape(-1, LANES)


@functools.cache
def _kept_tiles(mesh: Mesh, axis: str, dtype: str, fewest: int) -> int:
    """The fewest tiles ≥ ``fewest`` whose reduce-scatter over ``axis`` the compiler keeps
    (none tried if it keeps no small one either, as on v5e:4x4)."""
    if any(_keeps_reduce_scatter(mesh, axis, dtype, k * ROWS) for k in (2, 4, 8)):
        for tiles in _candidates(fewest):
            if _keeps_reduce_scatter(mesh, axis, dtype, tiles * ROWS):
                return tiles
    warnings.warn(
        f"On this TPU slice the compiler turns the reduce-scatter of a {fewest * TILE_ELEMENTS:,}"
        f"-element FSDP/ZeRO bucket over {axis!r} into an all-reduce for every tile shape "
        f"tried; the bucket will cost twice the plan's bytes.",
        stacklevel=4,
    )
    return fewest


def _candidates(fewest: int) -> list[int]:
    """Tile counts to try, in increasing order, within 1/16 of padding (or ``NEXT`` tiles, for
    small buckets): the next ``NEXT``, then the fewest multiple of each power of two."""
    powers = (-(-fewest // 2**j) * 2**j for j in range(1, fewest.bit_length() + 1))
    both = {*range(fewest, fewest + NEXT), *powers}
    return sorted(k for k in both if k <= fewest + max(fewest // 16, NEXT))


@functools.cache
def _keeps_reduce_scatter(mesh: Mesh, axis: str, dtype: str, rows: int) -> bool:
    """Compiles an all-gather of [rows, 128] per device over ``axis`` and its gradient (a
    reduce-scatter) for ``mesh``: does the program keep the reduce-scatter? The probe is
    asked while a step is being traced inside ``shard_map``, whose context (the mesh, the
    manual axes) is thread-local: it compiles in a thread of its own."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_compiled_kinds, mesh, axis, dtype, rows).result() == {"reduce-scatter"}


def _compiled_kinds(mesh: Mesh, axis: str, dtype: str, rows: int) -> set[str]:
    """The all-reduce / reduce-scatter kinds in the probe's compiled program."""

    def step(frag: jax.Array, w: jax.Array) -> jax.Array:
        loss = lambda f: jnp.sum(jax.lax.all_gather(f, axis).astype(jnp.float32) * w)  # noqa: E731
        return jax.grad(loss)(frag)

    n = mesh.shape[axis]
    probe = jax.shard_map(step, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis))
    frag = jax.ShapeDtypeStruct((n * rows, LANES), dtype, sharding=NamedSharding(mesh, P(axis)))
    w = jax.ShapeDtypeStruct((n, rows, LANES), np.float32, sharding=NamedSharding(mesh, P()))
    return set(_KINDS.findall(jax.jit(probe).lower(frag, w).compile().as_text() or ""))
