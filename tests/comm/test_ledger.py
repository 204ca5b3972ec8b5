"""Tests for shardkit.ledger: the HLO parser on literal snippets, then whole compiled programs.

Byte figures are per device per execution, hand-computed from the ring model (DESIGN.md):
an f32[4,4] block is V = 64 bytes.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.comm import hlo
from shardkit.comm.ledger import (
    KINDS,
    Collective,
    Ledger,
    Narrowing,
    format_table,
    measure,
    parse_hlo,
    widened,
)
from shardkit.mesh import make_mesh

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
"""


def module(*lines: str, computations: str = "", devices: int | None = 8) -> str:
    """An HLO module whose ENTRY holds ``lines`` (after a parameter ``%p = f32[4,4]``)."""
    header = "HloModule m" + (f", num_partitions={devices}" if devices else "")
    body = "\n".join(f"  {line}" for line in lines)
    return (
        f"{header}\n\n{ADD}\n{computations}\n"
        f"ENTRY %main (p: f32[4,4]) -> f32[4,4] {{\n  %p = f32[4,4]{{1,0}} parameter(0)\n"
        f"{body}\n}}\n"
    )


def only(text: str, mesh=None) -> Collective:
    (collective,) = parse_hlo(text, mesh)
    return collective


@pytest.fixture(scope="module")
def mesh_dm():
    return make_mesh({"data": 4, "model": 2})


def all_reduce(groups: str) -> str:
    return (
        f"%ar = f32[4,4]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )


# --------------------------------------------------------------------------- replica groups


@pytest.mark.parametrize(
    ("groups", "axes", "size"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model",), 2),
        ("{{0,2,4,6},{1,3,5,7}}", ("data",), 4),
        ("{{0,1,2,3,4,5,6,7}}", ("data", "model"), 8),
        ("{}", ("data", "model"), 8),
        ("[4,2]<=[8]", ("model",), 2),
        ("[2,4]<=[4,2]T(1,0)", ("data",), 4),
        ("[1,8]<=[8]", ("data", "model"), 8),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", ("model",), 2),
        ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2] {'axis_1'}", ("data",), 4),
        ("mesh[a=4,b=2] {a}", ("data",), 4),
        ("mesh['a'=4,'b'=2] {'a','b'}", ("data", "model"), 8),
        ("mesh['a'=4,'b'=2] {'a':(1)2}", ("data",), 2),  # the major half of a
        ("mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'a'}", ("model",), 2),
        ("mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'b'}", ("data",), 4),
        ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}", ("model",), 2),  # Shardy, no <=
    ],
)
def test_every_replica_group_spelling_maps_to_mesh_axes(mesh_dm, groups, axes, size):
    c = only(module(all_reduce(groups)), mesh_dm)
    assert (c.kind, c.axes, c.group_size) == ("all-reduce", axes, size)
    assert c.bytes_sent == 2 * (size - 1) / size * 64
    assert sorted(i for g in c.replica_groups for i in g) == list(range(8))


def test_iota_and_sub_axis_groups_list_the_right_devices(mesh_dm):
    def groups(spelling):
        return only(module(all_reduce(spelling)), mesh_dm).replica_groups

    assert groups("[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert groups("mesh['a'=4,'b'=2] {'a':(1)2}") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert groups("mesh['a'=4,'b'=2] {'a':(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert groups("mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'a'}") == (
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    )
    assert groups("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}") == (
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    )


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("{{0,2},{1,3},{4,6},{5,7}}", ("seq",)),
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model",)),
        ("{{0,1,2,3},{4,5,6,7}}", ("seq", "model")),
        ("{{0,1,4,5},{2,3,6,7}}", ("data", "model")),
        ("[2,4]<=[2,2,2]T(1,0,2)", ("data", "model")),
    ],
)
def test_groups_on_a_3d_mesh(groups, axes):
    mesh = make_mesh({"data": 2, "seq": 2, "model": 2})
    assert only(module(all_reduce(groups)), mesh).axes == axes


FACTORISATIONS = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 1, 8)]


@given(st.sampled_from(FACTORISATIONS), st.sets(st.sampled_from([0, 1, 2]), min_size=1))
def test_three_spellings_of_the_same_groups_agree(sizes, grouped):
    names = ("data", "seq", "model")
    grouped = sorted(grouped)
    rest = [a for a in range(3) if a not in grouped]
    per_group = int(np.prod([sizes[a] for a in grouped]))
    want = np.arange(8).reshape(sizes).transpose(rest + grouped).reshape(-1, per_group)
    explicit = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in want.tolist()) + "}"
    iota = f"[{8 // per_group},{per_group}]<=[{','.join(map(str, sizes))}]"
    iota += f"T({','.join(map(str, rest + grouped))})"
    axes = ",".join(f"'{n}'={s}" for n, s in zip(names, sizes, strict=True))
    meshed = f"mesh[{axes}] {{{','.join(repr(names[a]) for a in grouped)}}}"
    mesh = make_mesh(dict(zip(names, sizes, strict=True)))
    parsed = [only(module(all_reduce(g)), mesh) for g in (explicit, iota, meshed)]
    assert {c.replica_groups for c in parsed} == {tuple(map(tuple, want.tolist()))}
    assert {c.axes for c in parsed} == {tuple(names[a] for a in grouped if sizes[a] > 1)}


def test_without_a_mesh_axes_are_empty_and_the_header_counts_devices():
    c = only(module(all_reduce("{}")))
    assert (c.axes, c.group_size, c.bytes_sent) == ((), 8, 2 * 7 / 8 * 64)
    with pytest.raises(ValueError, match="mesh="):
        parse_hlo(module(all_reduce("{}"), devices=None))


def test_a_device_outside_the_mesh_is_an_error():
    mesh = make_mesh({"data": 2})
    with pytest.raises(ValueError, match="device 7"):
        parse_hlo(module(all_reduce("{{0,7}}")), mesh)


# --------------------------------------------------------------------------- kinds and bytes


@pytest.mark.parametrize(
    ("line", "kind", "size", "sent"),
    [
        (all_reduce("{{0,1},{2,3},{4,5},{6,7}}"), "all-reduce", 2, 64.0),
        (
            "%ag = f32[16,4]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,2,4,6},"
            "{1,3,5,7}}, dimensions={0}, use_global_device_ids=true",
            "all-gather",
            4,
            192.0,
        ),
        (
            "%rs = f32[1,4]{1,0} reduce-scatter(%p), channel_id=1, replica_groups={{0,2,4,6},"
            "{1,3,5,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add",
            "reduce-scatter",
            4,
            48.0,
        ),
        (
            "%a2a = (f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%s0, "
            "%s1, %s2, %s3), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}",
            "all-to-all",
            4,
            48.0,
        ),
        (
            "%a2a = f32[4,4]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,2,4,6},"
            "{1,3,5,7}}, dimensions={0}",
            "all-to-all",
            4,
            48.0,
        ),
        (
            "%cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, source_target_pairs="
            "{{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}",
            "collective-permute",
            4,
            64.0,
        ),
    ],
)
def test_each_kind_is_charged_its_ring_cost(mesh_dm, line, kind, size, sent):
    c = only(module(line), mesh_dm)
    assert (c.kind, c.axes, c.group_size, c.bytes_sent, c.count) == (
        kind,
        ("data",) if size == 4 else ("model",),
        size,
        sent,
        1,
    )


def test_tuple_all_to_all_keeps_every_shape(mesh_dm):
    c = only(
        module(
            "%a2a = (f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}) "
            "all-to-all(%s0, %s1, %s2, %s3), channel_id=1, "
            "replica_groups=[2,4]<=[4,2]T(1,0)"
        ),
        mesh_dm,
    )
    assert (c.shapes, c.dtypes, c.result_bytes) == (((1, 4),) * 4, ("f32",) * 4, 64)


def test_combined_tuple_all_reduce_sums_its_bytes(mesh_dm):
    c = only(
        module(
            "%ar = (f32[4,4]{1,0}, bf16[8]{0}, s32[2]{0}) all-reduce(%p, %q, %r), "
            "channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add"
        ),
        mesh_dm,
    )
    assert (c.result_bytes, c.bytes_sent) == (64 + 16 + 8, 88.0)


def test_widened_counts_narrowed_floats_as_written(mesh_dm):
    """A float32 program whose compiler sent some floats as bf16: ``widened`` counts them at
    32 bits (the contract's view) and says how many bytes the narrowing saved."""
    c = only(
        module(
            "%ar = (f32[4,4]{1,0}, bf16[8]{0}, s32[2]{0}) all-reduce(%p, %q, %r), "
            "channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add"
        ),
        mesh_dm,
    )
    wide, narrowed = widened(Ledger((c,)), "f32")
    assert (wide.collectives[0].result_bytes, wide.collectives[0].bytes_sent) == (104, 104.0)
    assert narrowed.count == 1 and narrowed.bytes_saved == pytest.approx(16.0)
    assert widened(Ledger((c,)), "bf16") == (Ledger((c,)), Narrowing())  # a bf16 program


def test_partial_permute_charges_the_busiest_sender(mesh_dm):
    # ppermute(x, "data", [(0, 1)]) on data=4 x model=2: only devices 0 and 1 send.
    edge = only(
        module(
            "%cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, "
            "source_target_pairs={{0,2},{1,3}}"
        ),
        mesh_dm,
    )
    assert (edge.axes, edge.group_size, edge.bytes_sent) == (("data",), 2, 64.0)
    fan_out = only(
        module(
            "%cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, "
            "source_target_pairs={{0,2},{0,4},{1,1}}"
        ),
        mesh_dm,
    )
    assert (fan_out.source_target_pairs, fan_out.bytes_sent) == (((0, 2), (0, 4)), 128.0)
    to_self = only(
        module(
            "%cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{3,3}}"
        ),
        mesh_dm,
    )
    assert (to_self.axes, to_self.bytes_sent) == ((), 0.0)


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[4,4]{1,0}", 64),
        ("bf16[4,4]{1,0}", 32),
        ("f16[4,4]", 32),
        ("s32[4,4]", 64),
        ("u32[4,4]", 64),
        ("s8[4,4]", 16),
        ("u8[4,4]", 16),
        ("pred[4,4]", 16),
        ("f64[4,4]", 128),
        ("s64[4,4]", 128),
        ("c64[4,4]", 128),
        ("f8e4m3fn[4,4]", 16),
        ("s4[4,4]", 8),
        ("f32[]", 4),
        ("f32[<=4,4]", 64),
        ("bf16[8,128]{1,0:T(8,128)(2,1)}", 2048),
    ],
)
def test_element_sizes(mesh_dm, shape, nbytes):
    c = only(
        module(
            f"%ar = {shape} all-reduce(%p), replica_groups={{{{0,1}},{{2,3}},{{4,5}},"
            "{6,7}}, to_apply=%add"
        ),
        mesh_dm,
    )
    assert c.result_bytes == nbytes


def test_an_unknown_element_type_is_an_error():
    with pytest.raises(ValueError, match="q7"):
        parse_hlo(module("%ar = q7[4] all-reduce(%p), replica_groups={}, to_apply=%add"))


# --------------------------------------------------------------------------- async pairs

ASYNC = [
    "%ags = (f32[4,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p), channel_id=1, "
    "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true",
    "%agd = f32[16,4]{1,0} all-gather-done(%ags)",
    "%ars = f32[4,4]{1,0} all-reduce-start(%p), channel_id=2, replica_groups=[4,2]<=[8], "
    "use_global_device_ids=true, to_apply=%add",
    "%ard = f32[4,4]{1,0} all-reduce-done(%ars)",
    "%cps = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(%p), "
    "channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}",
    "%cpd = f32[4,4]{1,0} collective-permute-done(%cps)",
    "%rss = ((f32[4,4]{1,0}), f32[1,4]{1,0}) reduce-scatter-start(%p), channel_id=4, "
    "replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}, to_apply=%add",
    "%rsu = ((f32[4,4]{1,0}), f32[1,4]{1,0}) reduce-scatter-update(%rss)",
    "%rsd = f32[1,4]{1,0} reduce-scatter-done(%rsu)",
]


def test_async_start_done_pairs_count_once(mesh_dm):
    got = [(c.kind, c.axes, c.shapes, c.bytes_sent) for c in parse_hlo(module(*ASYNC), mesh_dm)]
    assert got == [
        ("all-gather", ("data",), ((16, 4),), 192.0),
        ("all-reduce", ("model",), ((4, 4),), 64.0),
        ("collective-permute", ("model",), ((4, 4),), 64.0),
        ("reduce-scatter", ("data",), ((1, 4),), 48.0),
    ]


def test_unsugared_async_wrapper_counts_the_wrapped_collective_once(mesh_dm):
    wrapped = """%wrapped_a2a (w: f32[4,4]) -> f32[4,4] {
  %w = f32[4,4]{1,0} parameter(0)
  ROOT %a2a = f32[4,4]{1,0} all-to-all(%w), channel_id=5, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
}, execution_thread="main"
"""  # noqa: E501
    text = module(
        "%start = ((f32[4,4]{1,0}), f32[4,4]{1,0}, s32[]) async-start(%p), calls=%wrapped_a2a",
        "%update = ((f32[4,4]{1,0}), f32[4,4]{1,0}, s32[]) async-update(%start), "
        "calls=%wrapped_a2a",
        "ROOT %done = f32[4,4]{1,0} async-done(%update), calls=%wrapped_a2a",
        computations=wrapped,
    )
    c = only(text, mesh_dm)
    assert (c.kind, c.count, c.bytes_sent, c.computation) == ("all-to-all", 1, 48.0, "wrapped_a2a")


def fused_piece(name: str, root: str) -> str:
    """One piece of the TPU compiler's async collective fusion: its computation holds a copy
    of the all-gather and ends in ``root``."""
    return f"""%{name} (g: f32[4,4]) -> f32[16,4] {{
  %g = f32[4,4]{{1,0}} parameter(0)
  %ag = f32[16,4]{{1,0}} all-gather(%g), channel_id=1, replica_groups={{{{0,2,4,6}},{{1,3,5,7}}}}, dimensions={{0}}
  ROOT %r = f32[16,4]{{1,0}} {root}
}}
"""  # noqa: E501


MATMUL = """%matmul (m: f32[4,4]) -> f32[4,4] {
  %m = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%m, %m), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.mark.parametrize("beside", [True, False])
def test_an_async_collective_fusion_counts_once_at_its_start(mesh_dm, beside):
    """The TPU compiler's async collective fusion: a start fusion, a fusion carrying it on
    beside compute, a done fusion, each with a copy of the all-gather. One collective,
    recorded at its start; overlapped when a matmul runs between the start and the done."""
    pieces = (
        fused_piece("start_piece", 'custom-call(%ag), custom_call_target="AsyncCollectiveStart"')
        + fused_piece("async_collective_fusion.1", "copy(%ag)")
        + fused_piece("done_piece", 'custom-call(%ag), custom_call_target="AsyncCollectiveDone"')
        + MATMUL
    )
    lines = [
        "%s = f32[16,4]{1,0} fusion(%p), kind=kCustom, calls=%start_piece",
        "%c = f32[16,4]{1,0} fusion(%s), kind=kOutput, calls=%async_collective_fusion.1",
        "%mm = f32[4,4]{1,0} fusion(%p), kind=kOutput, calls=%matmul",
        "%d = f32[16,4]{1,0} fusion(%c), kind=kCustom, calls=%done_piece",
    ]
    if not beside:  # the matmul after the done: nothing hides the transfer
        lines[2], lines[3] = lines[3], lines[2]
    c = only(module(*lines, computations=pieces), mesh_dm)
    assert (c.kind, c.count, c.computation, c.bytes_sent) == ("all-gather", 1, "start_piece", 192)
    assert c.overlapped is beside


# --------------------------------------------------------------------------- loops and calls


def loop(name: str, body_lines: list[str]) -> str:
    """A while body ``name``, its condition ``name_cond``, over a (s32[], f32[4,4]) carry."""
    body = "\n".join(f"  {line}" for line in body_lines)
    return f"""%{name} (t: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {{
  %t = (s32[], f32[4,4]{{1,0}}) parameter(0)
  %x = f32[4,4]{{1,0}} get-tuple-element(%t), index=1
{body}
  ROOT %out = (s32[], f32[4,4]{{1,0}}) tuple(%i, %x)
}}

%{name}_cond (c: (s32[], f32[4,4])) -> pred[] {{
  %c = (s32[], f32[4,4]{{1,0}}) parameter(0)
  ROOT %lt = pred[] constant(true)
}}
"""


def while_op(body: str, trip: int | None) -> str:
    known = f',"known_trip_count":{{"n":"{trip}"}}' if trip is not None else ""
    return (
        f"%w_{body} = (s32[], f32[4,4]{{1,0}}) while(%t0), condition=%{body}_cond, "
        f'body=%{body}, backend_config={{"known_induction_variable":{{"tuple_index":"0"}}'
        f"{known}}}"
    )


CALLED = """%called (y: f32[4,4]) -> f32[4,4] {
  %y = f32[4,4]{1,0} parameter(0)
  ROOT %cp = f32[4,4]{1,0} collective-permute(%y), channel_id=9, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
}
"""  # noqa: E501


def test_collective_in_a_scan_body_counts_the_trip_count(mesh_dm):
    body = loop("body", [all_reduce("{{0,2,4,6},{1,3,5,7}}")])
    c = only(module(while_op("body", 5), computations=body), mesh_dm)
    assert (c.count, c.count_exact, c.computation, c.total_bytes_sent) == (5, True, "body", 480.0)


def test_nested_loops_multiply_and_calls_are_followed(mesh_dm):
    inner = loop("inner", [all_reduce("{{0,1},{2,3},{4,5},{6,7}}")])
    outer = loop(
        "outer",
        [
            while_op("inner", 3),
            "%called_once = f32[4,4]{1,0} call(%x), to_apply=%called",
            "%fused = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%called",
        ],
    )
    text = module(
        while_op("outer", 4),
        "%direct = f32[4,4]{1,0} call(%p), to_apply=%called",
        computations=CALLED + inner + outer,
    )
    got = {(c.kind, c.computation): c.count for c in parse_hlo(text, mesh_dm)}
    # `called` runs twice per outer iteration (call + fusion) and once from ENTRY: 4*2 + 1.
    assert got == {("collective-permute", "called"): 9, ("all-reduce", "inner"): 12}


def test_a_loop_without_known_trip_count_is_flagged(mesh_dm):
    body = loop("body", [all_reduce("{}")])
    c = only(module(while_op("body", None), computations=body), mesh_dm)
    assert (c.count, c.count_exact) == (1, False)


def test_unreachable_computations_do_not_run(mesh_dm):
    (c,) = parse_hlo(module(all_reduce("{}"), computations=CALLED), mesh_dm)
    assert c.kind == "all-reduce"  # the collective-permute in `called` never runs


# --------------------------------------------------------------------------- metadata

STACK_TABLES = """
FileNames
1 "/home/me/model.py"

FunctionNames
1 "block"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=8 end_column=30}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
"""


def test_metadata_gives_op_name_and_source(mesh_dm):
    legacy = only(
        module(
            all_reduce("{}") + ', metadata={op_name="jit(f)/shard_map/psum" '
            'source_file="/x/y.py" source_line=7}'
        ),
        mesh_dm,
    )
    assert (legacy.op_name, legacy.source) == ("jit(f)/shard_map/psum", "/x/y.py:7")
    text = module(all_reduce("{}") + ', metadata={op_name="jit(f)/psum" stack_frame_id=1}')
    text = text.replace(
        "HloModule m, num_partitions=8\n", "HloModule m, num_partitions=8\n" + STACK_TABLES
    )
    framed = only(text, mesh_dm)
    assert (framed.op_name, framed.source, framed.name) == (
        "jit(f)/psum",
        "/home/me/model.py:42",
        "ar",
    )


# --------------------------------------------------------------------------- captured HLO

# Lines captured from jax 0.10.2 on 8 CPU devices: jit of x @ w with x[B_data, D_model],
# w[D_model, F] (XLA's automatic partitioner), and a scan over a shard_map psum.
CAPTURED = """HloModule jit_f, is_scheduled=true, num_partitions=8

%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x.1, %y.1)
}

%region_8.9_spmd (param: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %param = (s32[], f32[4,4]{1,0}) parameter(0), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %get-tuple-element.33 = f32[4,4]{1,0} get-tuple-element(%param), index=1
  %get-tuple-element.32 = s32[] get-tuple-element(%param), index=0
  %psum.13 = f32[4,4]{1,0} all-reduce(%get-tuple-element.33), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(body)/shard_map/while/body/closed_call/psum" stack_frame_id=43}
  ROOT %tuple.12 = (s32[], f32[4,4]{1,0}) tuple(%get-tuple-element.32, %psum.13)
}

%region_10.10_spmd (param.1: (s32[], f32[4,4])) -> pred[] {
  %param.1 = (s32[], f32[4,4]{1,0}) parameter(0)
  ROOT %constant = pred[] constant(true)
}

ENTRY %main.0_spmd (param: f32[4,4], param.2: f32[4,32]) -> f32[] {
  %param = f32[4,4]{1,0} parameter(0), sharding={devices=[4,2]<=[8]}
  %all-gather = f32[16,4]{1,0} all-gather(%param), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
  %all-reduce = f32[16,8]{1,0} all-reduce(%ynn_fusion), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
  ROOT %all-reduce.1 = f32[] all-reduce(%multiply_reduce_fusion), channel_id=3, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(f)/reduce_sum" stack_frame_id=5}
  %while.20 = (s32[], f32[4,4]{1,0}) while(%tuple.10), condition=%region_10.10_spmd, body=%region_8.9_spmd, metadata={op_name="jit(body)/shard_map/while/body/closed_call/while" stack_frame_id=41}, backend_config={"dynamic_variables":[],"known_induction_variable":{"tuple_index":"0"},"known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"2"}}
}
"""  # noqa: E501


def test_captured_hlo(mesh_dm):
    got = [
        (c.kind, c.axes, c.group_size, c.count, c.bytes_sent, c.op_name)
        for c in parse_hlo(CAPTURED, mesh_dm)
    ]
    assert got == [
        (
            "all-reduce",
            ("data", "model"),
            8,
            2,
            112.0,
            "jit(body)/shard_map/while/body/closed_call/psum",
        ),
        ("all-gather", ("data",), 4, 1, 192.0, "jit(f)/dot_general"),
        ("all-reduce", ("model",), 2, 1, 512.0, "jit(f)/dot_general"),
        ("all-reduce", ("data",), 4, 1, 6.0, "jit(f)/reduce_sum"),
    ]


def test_auto_partitioned_program_end_to_end(mesh_dm):
    """XLA's own partitioner prints iota and mesh[...] groups; the ledger still names axes."""
    x = jax.device_put(jnp.ones((16, 8), jnp.float32), NamedSharding(mesh_dm, P("data", "model")))
    w = jax.device_put(jnp.ones((8, 32), jnp.float32), NamedSharding(mesh_dm, P("model", None)))

    def f(x, w):
        y = lax.with_sharding_constraint(x @ w, NamedSharding(mesh_dm, P(None, "data")))
        return jnp.sum(y**2)

    ledger = measure(f, x, w)  # plain function; the mesh comes from the input shardings
    assert {(c.kind, c.axes) for c in ledger.collectives} == {
        ("all-gather", ("data",)),
        ("all-reduce", ("model",)),
        ("all-reduce", ("data",)),
    }


# --------------------------------------------------------------------------- end to end


def scanned_program(mesh):
    """Every collective once outside a scan, three more inside (one in a nested scan)."""
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def inner(c, _):
        return lax.psum(c, ("data", "model")) + c, None

    def outer(c, _):
        c, _ = lax.scan(inner, c, None, length=2)
        mixed = lax.psum(c, "data") + c
        return lax.ppermute(mixed, "model", [(0, 1), (1, 0)]), None

    def body(x_block):  # x_block[B_data, D_model]: f32[4,4], V = 64 bytes
        assert x_block.shape == (4, 4)
        summed = lax.psum(x_block, "model")  # removes {U_model}
        gathered = lax.all_gather(x_block, "data", tiled=True)
        shifted = lax.ppermute(x_block, "data", ring)
        swapped = lax.all_to_all(x_block, "data", 0, 1, tiled=True)
        scattered = lax.psum_scatter(x_block, "data", scatter_dimension=0, tiled=True)
        edge = lax.ppermute(x_block, "data", [(0, 1)])  # only data=0 sends
        looped, _ = lax.scan(outer, x_block, None, length=3)
        return summed, gathered, shifted, swapped, scattered, edge, looped

    varying = P("data", "model")
    out_specs = (P("data", None), *[varying] * 6)  # all_gather's result stays varying
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=varying, out_specs=out_specs, check_vma=True)
    )


@pytest.fixture(scope="module")
def scanned_ledger(mesh_dm):
    return measure(scanned_program(mesh_dm), jnp.ones((16, 8), jnp.float32), mesh=mesh_dm)


def test_scanned_program_counts_and_bytes_are_exact(scanned_ledger):
    got = sorted(
        (c.kind, c.axes, c.group_size, c.count, c.bytes_sent) for c in scanned_ledger.collectives
    )
    assert got == sorted(
        [
            ("all-reduce", ("model",), 2, 1, 64.0),  # 2(2-1)/2 * 64
            ("all-gather", ("data",), 4, 1, 192.0),  # 3/4 * 256 gathered
            ("collective-permute", ("data",), 4, 1, 64.0),
            ("all-to-all", ("data",), 4, 1, 48.0),  # 3/4 * 64
            ("reduce-scatter", ("data",), 4, 1, 48.0),  # 3/4 * 64 input
            ("collective-permute", ("data",), 2, 1, 64.0),  # partial: busiest sender sends V
            ("all-reduce", ("data", "model"), 8, 6, 112.0),  # 2*7/8 * 64, 3 x 2 iterations
            ("all-reduce", ("data",), 4, 3, 96.0),  # 2*3/4 * 64
            ("collective-permute", ("model",), 2, 3, 64.0),
        ]
    )
    assert scanned_ledger.total_bytes_sent() == 64 + 192 + 64 + 48 + 48 + 64 + 672 + 288 + 192
    assert all(c.count_exact and "test_ledger.py:" in c.source for c in scanned_ledger.collectives)


def test_summary_json_and_table(scanned_ledger):
    summary = scanned_ledger.summary()
    assert (
        summary[("collective-permute", ("data",))].count,
        summary[("collective-permute", ("data",))].bytes_sent,
    ) == (2, 128.0)
    report = scanned_ledger.to_json()
    assert set(report) == {"collectives", "measured_bytes_sent", "flops", "memory"}
    assert set(report["memory"]) == {"argument", "output", "temp"}
    assert report["memory"]["argument"] == 64  # one f32[4,4] block per device
    assert all(
        set(row) == {"kind", "axes", "count", "bytes_sent"} and row["kind"] in KINDS
        for row in report["collectives"]
    )
    assert sum(row["bytes_sent"] for row in report["collectives"]) == 1632.0
    assert report["measured_bytes_sent"] == 1632.0
    json.dumps(report)
    table = format_table(scanned_ledger)
    assert str(scanned_ledger) == table and "HloModule" not in repr(scanned_ledger)
    assert "all-reduce          data,model             8       6             672" in table
    assert "1,632" in table and "loop bodies counted once" in table
    assert scanned_ledger.xla_flops is not None and scanned_ledger.xla_flops > 0


def test_grad_of_an_invariant_input_adds_its_psum(mesh_dm):
    """With check_vma, the transpose of w's implicit broadcast over data is a psum of dw."""

    def loss(w, x):
        def block(w, x_block):  # x_block[B_data, D] . w[D, F] -> y[B_data, F]
            return jnp.sum(jnp.tanh(x_block @ w), keepdims=True)[0]

        local = jax.shard_map(
            block, mesh=mesh_dm, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=True
        )(w, x)
        return jnp.sum(local)

    w, x = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
    ledger = measure(jax.grad(loss), w, x, mesh=mesh_dm)
    (dw_sum,) = ledger.select("all-reduce", ("data",))
    assert (dw_sum.shapes, dw_sum.bytes_sent) == (((8, 16),), 2 * 3 / 4 * 512)


def test_ledger_of_nothing():
    empty = Ledger(())
    assert (empty.total_bytes_sent(), empty.summary()) == (0, {})
    assert empty.to_json()["memory"] == {"argument": None, "output": None, "temp": None}


class _Compiled:
    """A compiled program whose inputs and outputs carry no NamedSharding (e.g. pmap-era code)."""

    input_shardings = ((jax.sharding.SingleDeviceSharding(jax.devices()[0]),), {})
    output_shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def __init__(self, hlo: str) -> None:
        self.hlo = hlo

    def as_text(self) -> str:
        return self.hlo

    def memory_analysis(self) -> None:
        return None

    def cost_analysis(self) -> dict:
        return {}


def test_a_program_without_a_mesh_is_refused_not_mislabelled() -> None:
    from shardkit.comm.ledger import ledger_of

    text = module(all_reduce("{{0,1},{2,3},{4,5},{6,7}}"))
    with pytest.raises(ValueError, match=r"cannot name the mesh axes .* pass mesh=<the Mesh>"):
        ledger_of(_Compiled(text))
    assert ledger_of(_Compiled(module("%n = f32[4,4]{1,0} negate(%p)"))).collectives == ()


def test_the_table_counts_groups_of_one_on_one_line():
    """A collective over a size-1 axis sends nothing: no 0-byte row, one line saying so."""
    common = dict(axes=("seq",), shapes=((4,),), dtypes=("f32",), result_bytes=16, count=1,
                  op_name="", source="", computation="main")  # fmt: skip
    alone = Collective(kind="all-reduce", group_size=1, bytes_sent=0.0, name="ar.1", **common)
    real = Collective(kind="all-reduce", group_size=2, bytes_sent=16.0, name="ar.2", **common)
    table = str(Ledger((alone, real)))
    assert table.count("all-reduce") == 1 and "1 collectives over groups of one device" in table


def test_matmul_flops_count_every_dot_by_its_executions():
    """``Ledger.flops``: 2·m·n·k per dot, a scan's by its trip count (XLA's own ``cost_analysis``
    counts the body once), and a convolution by its kernel per output feature."""
    x, w = jnp.ones((4, 6, 8)), jnp.ones((8, 16))
    one = measure(lambda x, w: jnp.einsum("btd,dk->btk", x, w), x, w)
    assert one.flops == 2 * 4 * 6 * 8 * 16
    scanned = measure(lambda x, w: lax.scan(lambda c, _: (c @ w[:, :8], None), x, None, 5)[0], x, w)
    assert scanned.flops == 5 * 2 * 4 * 6 * 8 * 8
    assert [m.count for m in scanned.matmuls] == [5]
    images, kernel = jnp.ones((2, 8, 8, 3)), jnp.ones((4, 4, 3, 5))

    def patches(a, k):
        return lax.conv_general_dilated(
            a, k, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    conv = measure(patches, images, kernel)
    assert conv.flops == 2 * (2 * 2 * 2 * 5) * (4 * 4 * 3)


TPU_BATCHED_MATMUL = """HloModule step

ENTRY %main (q: bf16[32,196,12,64], k: bf16[32,196,12,64]) -> f32[32,12,196,196] {
  %q = bf16[32,196,12,64]{3,2,1,0} parameter(0)
  %k = bf16[32,196,12,64]{3,2,1,0} parameter(1)
  ROOT %scores = f32[32,12,196,196]{2,3,1,0} convolution(%q, %k), WINDOW
}
""".replace(
    "WINDOW", "window={size=32x12 stride=31x11 lhs_dilate=32x12}, dim_labels=0b1f_0o1i->01bf"
)


def test_a_batched_matmul_the_tpu_compiler_wrote_as_a_convolution_counts_once():
    """The TPU compiler writes ``bqhk,bshk->bhqs`` as a convolution whose window spans the batch
    dims (b, h) with ``lhs_dilate`` = window, so each output position reads one (b, h) element:
    its FLOPs are the matmul's, 2·b·h·q·s·k, not the window's b·h times that."""
    (scores,) = hlo.parse_matmuls(TPU_BATCHED_MATMUL)
    assert scores.flops == 2 * 32 * 12 * 196 * 196 * 64


def test_a_dilated_padded_convolution_counts_the_pairs_that_read_an_input():
    """Padding and input dilation add window positions that read nothing: the count is the
    brute-force count of (output, window) pairs that land on an input element."""
    x, k = jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4))

    def conv(a, b):
        return lax.conv_general_dilated(a, b, (2,), [(2, 1)], lhs_dilation=(2,),
                                        dimension_numbers=("NWC", "WIO", "NWC"))  # fmt: skip

    got = measure(conv, x, k)
    outputs = conv(x, k).shape[1]
    last = (5 - 1) * 2
    pairs = sum(0 <= o * 2 + w - 2 <= last and (o * 2 + w - 2) % 2 == 0
                for o in range(outputs) for w in range(3))  # fmt: skip
    assert got.flops == 2 * 4 * 2 * pairs


def test_fused_collectives_a_compiler_kept_apart_are_named_not_failed():
    """Two step-end all-reduces the contract fuses into one (XLA:CPU's combiner), kept apart
    by the compiler with the same bytes: a mismatch by default; with ``apart_ok`` (the TPU
    compiler, past its combine threshold) held as fused and named. A third op, or other bytes,
    still fail."""
    from shardkit.comm.ledger import GROUPS
    from shardkit.comm.report import Report
    from shardkit.comm.terms import Expectation, Term

    def op(name: str, sent: float) -> Collective:
        return Collective(kind="all-reduce", group_size=2, axes=("data",), shapes=((4,),),
                          dtypes=("f32",), result_bytes=16, bytes_sent=sent, count=1,
                          name=name, op_name="", source="", computation="main",
                          pattern=GROUPS)  # fmt: skip

    terms = (Term("all-reduce", ("data",), 1, 12.0, fused="end"),
             Term("all-reduce", ("data",), 1, 4.0, fused="end"))  # fmt: skip
    apart = Ledger((op("ar.1", 12.0), op("ar.2", 4.0)))
    assert not Report(apart, Expectation(terms)).contract_ok
    held = Report(apart, Expectation(terms), apart_ok=True)
    assert held.contract_ok and held.kept_apart == [
        "all-reduce over data: 2 ops where the contract fuses them into 1, the same bytes"
    ]
    (row,) = held.rows
    assert (row.count, row.held_count, row.ok) == (2, 1, True)  # the table shows what ran
    three = Ledger((op("ar.1", 8.0), op("ar.2", 4.0), op("ar.3", 4.0)))
    assert not Report(three, Expectation(terms), apart_ok=True).contract_ok
    more = Ledger((op("ar.1", 12.0), op("ar.2", 8.0)))
    assert not Report(more, Expectation(terms), apart_ok=True).contract_ok
