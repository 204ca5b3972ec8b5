"""``inspect --target``: a plan compiled for a TPU slice by the TPU compiler on this CPU machine
(libtpu's topology description, no chip), held to its contract and to the chip's HBM.

libtpu comes with the ``tpu`` extra, which the README's test command installs; ``conftest``
keeps this process's own backend on the CPU (``JAX_PLATFORMS=cpu``). A small ViT keeps each
TPU compile to seconds.
"""

from __future__ import annotations

import importlib.util
import json

import jax
import pytest

import vit_ref
from shardkit import cli
from shardkit.run import target

SMALL = ["--variant", "mu", "--depth", "2", "--heads", "2", "--batch", "16"]


def inspect_json(capsys, *argv: str) -> dict:
    assert cli.main(["inspect", "--target", "v5e:2x4", "--json", *SMALL, *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mesh", ["data=8", "data=4,model=2"])
def test_data_and_tensor_parallel_hold_their_contracts_on_the_tpu_compiler(capsys, mesh):
    """DP and DP×TP compiled for v5e:2x4: contracts exact on the TPU compiler's program (its
    scans carry no known_trip_count: the ledger reads the trip count from each loop), the
    memory held to the v5e's 16 GiB, and the overlapped share of the bytes reported."""
    got = inspect_json(capsys, "--mesh", mesh)
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0)
    assert got["fit"]["device_kind"] == "TPU v5 lite"
    assert got["fit"]["fits"] and got["fit"]["hbm_bytes"] == 16 * 2**30
    assert 0 < got["fit"]["peak_bytes"] < 2**30
    assert 0.0 <= got["overlapped_fraction"] <= 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh", "data=2,seq=4", "--sp", "ring"],
        ["--mesh", "data=2,seq=4", "--sp", "ulysses", "--heads", "4"],
        ["--mesh", "data=4,stage=2", "--pp", "1f1b", "--microbatches", "2"],
    ],
    ids=["ring", "ulysses", "1f1b"],
)
def test_sequence_and_pipeline_plans_hold_their_contracts_on_the_tpu_compiler(capsys, argv):
    """The ring (its hops a scan inside the layer scan, whose counter the TPU compiler copies),
    Ulysses and a 1F1B pipeline: counts exact on the TPU compiler's program. The compiler sends
    the ring's K/V and Ulysses' forward all-to-alls in bf16 (a float32 model): the contract
    holds them to what the program wrote and the report names the narrowing and its bytes."""
    got = inspect_json(capsys, *argv)
    assert got["contract_ok"], got["mismatches"]
    saved = got["narrowed"]["bytes_saved"]
    assert (saved > 0) == ("--sp" in argv)
    assert got["measured_bytes_sent"] == pytest.approx(got["expected_bytes_sent"] - saved)
    assert got["fit"]["fits"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh", "data=2,seq=4", "--sp", "usp", "--heads", "4"],
        ["--mesh", "data=2,seq=2,model=2", "--sp", "megatron", "--heads", "4"],
        ["--mesh", "data=2,seq=2,model=2", "--sp", "megatron", "--ulysses", "2", "--heads", "4"],
        ["--mesh", "data=4,stage=2", "--pp", "gpipe", "--microbatches", "2"],
        ["--mesh", "data=2,stage=4", "--pp", "interleaved", "--microbatches", "4",
         "--virtual", "2", "--depth", "8"],
        ["--mesh", "data=4,stage=2", "--pp", "zb", "--microbatches", "2"],
        ["--mesh", "data=4,stage=2", "--pp", "zbv", "--microbatches", "2", "--depth", "4"],
        ["--mesh", "data=8", "--fsdp"],
        ["--mesh", "data=8", "--zero", "2", "--remat", "dots"],
        ["--mesh", "data=4,model=2", "--fsdp", "--remat", "full"],
    ],
    ids=["usp", "megatron-ring", "megatron-ulysses", "gpipe", "interleaved", "zb", "zbv",
         "fsdp-small-buckets", "zero2-remat", "fsdp-tp-remat"],
)  # fmt: skip
def test_every_other_strategy_holds_its_contract_on_the_tpu_compiler(capsys, argv):
    """The rest of the plan space on the small ViT: USP, Megatron-SP over a seq ring or
    Ulysses, every pipeline schedule, and FSDP / ZeRO with recomputation and with buckets of
    a few thousand elements (each padded to whole tiles: flat, the TPU compiler made every one
    an all-reduce, 1.99x). Exact where nothing is narrowed; the narrowed bf16 hops and
    all-to-alls of this float32 model held as written and named."""
    got = inspect_json(capsys, *argv)
    assert got["contract_ok"], got["mismatches"]
    saved = got["narrowed"]["bytes_saved"]
    assert got["measured_bytes_sent"] == pytest.approx(got["expected_bytes_sent"] - saved)
    assert got["fit"]["fits"]


def test_fsdp_keeps_its_gathers_and_reduce_scatters_on_the_tpu_compiler(capsys):
    """FSDP over 8 (Ti/16, 2 layers): on a TPU mesh the
    buckets travel as padded [r, 128] tiles, so the TPU compiler keeps every all-gather and
    reduce-scatter (flat, each became an all-reduce: 1.99x the bytes), and the contract, which
    states the padding, holds exactly."""
    argv = ["inspect", "--target", "v5e:2x4", "--json", "--variant", "Ti/16", "--depth", "2",
            "--batch", "16", "--mesh", "data=8", "--fsdp"]  # fmt: skip
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0)
    kinds = {row["kind"]: row["count"] for row in got["collectives"]}
    assert kinds == {"all-reduce": 1, "all-gather": 3, "reduce-scatter": 3}


def test_a_bf16_fsdp_tp_plan_holds_with_its_narrowed_gathers_named(capsys):
    """FSDP×TP of a bf16 model (S/16, 2 layers): the TPU compiler moves the cast of the
    float32 weights to bf16 before two of their all-gathers (their only readers are matmuls),
    sending fewer bytes than written; the report counts them as written, names them as
    narrowed, and the contract holds (ViT-B/16: 12 gathers, 63.7 MB saved)."""
    argv = ["inspect", "--target", "v5e:2x4", "--json", "--variant", "S/16", "--depth", "2",
            "--batch", "64", "--dtype", "bfloat16", "--mesh", "data=4,model=2",
            "--fsdp"]  # fmt: skip
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["contract_ok"], got["mismatches"]
    assert got["narrowed"]["count"] == 2 and got["ratio"] < 1.0


@pytest.mark.parametrize("zero", ["1", "2"])
def test_zero_keeps_its_gathers_and_reduce_scatters_on_the_tpu_compiler(capsys, zero):
    """ZeRO-1 and ZeRO-2 over 8 (Ti/16, 2 layers): on a TPU mesh their buckets travel as padded
    [r, 128] tiles like FSDP's, so the TPU compiler keeps the reduce-scatters and the
    all-gather (flat, both became all-reduces: 1.997x the bytes), and the contract holds."""
    argv = ["inspect", "--target", "v5e:2x4", "--json", "--variant", "Ti/16", "--depth", "2",
            "--batch", "16", "--mesh", "data=8", "--zero", zero]  # fmt: skip
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0)
    kinds = {row["kind"]: row["count"] for row in got["collectives"]}
    assert kinds == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1 if zero == "1" else 3}


def test_a_bf16_ring_sends_its_last_dkv_hop_in_bf16_and_holds_exactly(capsys):
    """In a bf16 model the ring's float32 dK/dV accumulators make their last hop home already
    cast to bf16 (the TPU compiler moved that cast before the permute, and the contract read
    0.976x); the program now writes it so, and the contract holds with nothing narrowed."""
    got = inspect_json(capsys, "--mesh", "data=2,seq=4", "--sp", "ring", "--dtype", "bfloat16")
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0)
    assert got["narrowed"]["count"] == 0


@pytest.mark.parametrize(
    "argv",
    [["--variant", "B/16", "--depth", "1", "--fsdp"], ["--variant", "S/16", "--depth", "2",
     "--zero", "1"]],
    ids=["fsdp-B/16", "zero1-S/16"],
)  # fmt: skip
def test_large_buckets_keep_their_reduce_scatters_on_the_tpu_compiler(capsys, argv):
    """Buckets past 152 tiles per chip (ViT-B/16's per-layer FSDP bucket, 433 tiles at the
    fewest; S/16's ZeRO-1 bucket): v5e:2x4's compiler keeps a reduce-scatter only for some
    row counts, and turned these into all-reduces (1.41x and 1.50x the plan's bytes). The
    probed tiles (``parallel.tiles``) keep them, and the contract states their padding."""
    head = ["inspect", "--target", "v5e:2x4", "--json", "--mesh", "data=8", "--batch", "8"]
    assert cli.main([*head, *argv]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0)
    kinds = {row["kind"]: row["count"] for row in got["collectives"]}
    assert kinds["all-reduce"] == 1  # the loss alone
    assert kinds["reduce-scatter"] == kinds["all-gather"] >= 1


def test_bf16_gradient_sync_halves_the_all_reduce_bytes_on_the_tpu_compiler(capsys):
    """``--grad-sync bfloat16`` (XLA auto's bf16 gradient all-reduce as a plan option): DP 8's
    gradient bucket travels in bf16, half the bytes, held exactly by the contract; the float32
    loss then travels apart, named as kept apart, and nothing is read as narrowed."""
    f32, bf16 = (inspect_json(capsys, "--mesh", "data=8", "--grad-sync", dtype)
                 for dtype in ("float32", "bfloat16"))  # fmt: skip
    assert bf16["contract_ok"], bf16["mismatches"]
    assert bf16["measured_bytes_sent"] == pytest.approx(f32["measured_bytes_sent"] / 2, rel=1e-3)
    assert bf16["narrowed"]["count"] == 0
    assert bf16["kept_apart"] == ["all-reduce over data: 2 ops where the contract fuses them "
                                  "into 1, the same bytes"]  # fmt: skip


def test_tiles_probe_the_compiler_for_a_row_count_it_keeps():
    """On v5e:2x4 a bucket of 433 tiles per chip loses its reduce-scatter; the probe moves it to
    the next row count the compiler keeps (< 1% padding). On v5e:4x4 the compiler keeps no
    reduce-scatter at all: the fewest tiles, and a warning that the bucket costs twice."""
    from jax.experimental import topologies

    from shardkit.mesh import make_mesh
    from shardkit.parallel import tiles as tl

    def mesh(topology: str, n: int):
        return make_mesh({"data": n}, topologies.get_topology_desc(topology, "tpu").devices)

    v5e8 = mesh("v5e:2x4", 8)
    assert not tl._keeps_reduce_scatter(v5e8, "data", "float32", 433 * tl.ROWS)
    kept = tl.Tiles(v5e8).elements(885_312)  # ViT-B/16's per-layer FSDP bucket per chip
    assert tl._keeps_reduce_scatter(v5e8, "data", "float32", kept // tl.LANES)
    assert 885_312 < kept < 1.01 * 885_312
    with pytest.warns(UserWarning, match="twice the plan's bytes"):
        assert tl.Tiles(mesh("v5e:4x4", 16)).elements(885_312) == 433 * tl.TILE_ELEMENTS


def test_maxtexts_libtpu_flags_reach_the_compiler_and_overlap_ulysses(capsys):
    """``--tpu-flags maxtext`` passes MaxText's overlap flags to each compile (a compile-only
    libtpu does not read LIBTPU_INIT_ARGS): Ulysses' all-to-alls become async and some of
    their bytes hide under matmuls, where the default flags hide none."""
    argv = ["--mesh", "data=2,seq=4", "--sp", "ulysses", "--heads", "4"]
    default = inspect_json(capsys, *argv)
    tuned = inspect_json(capsys, *argv, "--tpu-flags", "maxtext")
    assert default["overlapped_fraction"] == 0.0 < tuned["overlapped_fraction"]
    assert tuned["measured_bytes_sent"] == default["measured_bytes_sent"]


def test_tpu_flags_need_a_target(capsys):
    assert cli.main(["inspect", "--tpu-flags", "maxtext", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "--tpu-flags sets the TPU compiler's flags: it needs --target." in err


def test_overlapped_megatron_sp_holds_its_contract_and_hides_its_bytes(capsys):
    """Megatron-SP with --overlap compiled for v5e:2x4 (layers unrolled): its rings of
    permutes hold the contract exactly on the TPU compiler's program, and 76% of the step's
    bytes have a matmul scheduled between start and done (ViT-B/16: 98%). The plain regions hold
    their contract too (each all-gather the TPU compiler splits into an async collective
    fusion counted once) and hide only what those fusions put beside a matmul (14%)."""
    argv = ["--mesh", "data=2,model=4", "--sp", "megatron", "--layers", "unrolled"]
    overlapped = inspect_json(capsys, *argv, "--overlap", "--heads", "4")
    assert overlapped["contract_ok"], overlapped["mismatches"]
    assert overlapped["overlapped_fraction"] > 0.7
    plain = inspect_json(capsys, *argv, "--heads", "4")
    assert plain["contract_ok"], plain["mismatches"]
    assert 0.0 < plain["overlapped_fraction"] < 0.25


@pytest.mark.parametrize(
    "plan, hidden", [("--fsdp", 0.55), ("", 0.5), ("--zero 2", 0.2)], ids=["FSDP", "DP", "ZeRO-2"]
)
def test_fsdp_and_dp_overlap_hide_each_layer_under_its_neighbours_matmuls(capsys, plan, hidden):
    """FSDP, DP and ZeRO-2 with --overlap compiled for v5e:2x4 (Ti/16, 3 layers, scanned): the
    same bytes as the plain plan (contracts exact). FSDP gathers layer i + 1 in layer i's step
    (an async collective fusion beside its matmuls) and reduce-scatters its gradient in layer
    i's backward step as permutes, which the compiler runs beside the backward's matmuls; DP
    all-reduces each layer's gradients there as a reduce-scatter of permutes and an
    all-gather; ZeRO-2 reduce-scatters them there as permutes (its all-gather of the updated
    params, half its bytes, ends the step with nothing to hide under). 61%, 54% and 26% of
    the step's bytes hidden here (ViT-B/16: 97.6%, 93.6% and 49%); the plain plans hide none
    (0%): a reduce-scatter or all-reduce is synchronous on this compiler. Temporaries: 30.2
    against 61.7 MB (FSDP), 25.4 against 31.1 MB (DP), 24.3 against 61.5 MB (ZeRO-2). (Not
    always below: with 2 heads DP's overlapped step holds 27.2 MB against 19.6, 4.2 layers
    more, the scheduler's choice; at 6 layers, and for ViT-B/16, it holds less.)"""
    argv = ["--variant", "Ti/16", "--depth", "3", "--dtype", "bfloat16", "--mesh", "data=8",
            "--heads", "3", "--batch", "64", *plan.split()]  # fmt: skip
    plain, overlapped = (inspect_json(capsys, *argv, *extra) for extra in ([], ["--overlap"]))
    for report in (plain, overlapped):
        assert report["contract_ok"] and report["ratio"] == 1.0, report["mismatches"]
    assert plain["overlapped_fraction"] == 0.0
    assert overlapped["overlapped_fraction"] > hidden
    # Temporaries: at most one layer's params (float32) more than the plain step's.
    cfg = vit_ref.variant("Ti/16", depth=3)
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))["blocks"]
    layer = sum(leaf.size // leaf.shape[0] * 4 for leaf in jax.tree.leaves(shapes))
    assert overlapped["memory"]["temp"] <= plain["memory"]["temp"] + layer


def test_a_plan_that_does_not_fit_is_one_sentence(capsys):
    argv = ["inspect", "--target", "v5e:2x2", "--mesh", "data=4", "--variant", "Ti/16",
            "--depth", "2", "--batch", "8192"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardkit: error: The plan does not fit a TPU v5 lite chip (")
    assert "exceeds available HBM" in err and "largest arrays of the step: f32[" in err
    assert err.count("\n") == 0


def test_target_mistakes_are_one_sentence(capsys, monkeypatch):
    assert cli.main(["inspect", "--target", "v5e:9x9", "--mesh", "data=8", *SMALL]) == 2
    assert "libtpu does not know the topology 'v5e:9x9'" in capsys.readouterr().err
    assert cli.main(["inspect", "--target", "v5e:2x4", "--mesh", "data=4", *SMALL]) == 2
    assert "has 8 chips but the mesh uses 4" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    with pytest.raises(target.TargetError, match=r"needs libtpu: pip install 'shardkit\[tpu\]'"):
        target.topology_devices("v5e:2x4")


def test_bench_target_compiles_shardkit_and_auto_side_by_side(capsys):
    """``bench --target``: per strategy, shardkit's and XLA auto's steps compiled for the slice,
    never run: bytes, hidden share, memory and the planner's estimate, shardkit's contract; DP's
    bytes the same for both (one gradient all-reduce)."""
    argv = ["bench", "--target", "v5e:2x4", "--strategies", "DP,ring", "--json", *SMALL[:-2],
            "--batch", "16"]  # fmt: skip
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["device_kind"] == "TPU v5 lite" and got["flags"] == "default"
    rows = {row["strategy"]: row for row in got["rows"]}
    assert set(rows) == {"DP", "ring"}
    for row in rows.values():
        for who in ("shardkit", "auto"):
            assert row[who]["error"] is None and row[who]["fits"]
            assert row[who]["step_s"] > 0 and 0.0 <= row[who]["hidden_fraction"] <= 1.0
    assert rows["DP"]["shardkit"]["contract_ok"]
    assert rows["DP"]["shardkit"]["bytes_sent"] == pytest.approx(rows["DP"]["auto"]["bytes_sent"])
    assert rows["ring"]["shardkit"]["hidden_fraction"] > 0  # the ring's permutes are async


def test_bench_target_overlaps_every_strategy_that_allows_it(capsys):
    """``bench --target --strategies ... --overlap``: each strategy's plan with ``--overlap``
    where it allows it (DP: each layer's gradients synced one layer behind, its contract held,
    its bytes partly hidden where plain DP hides none), and the rows it cannot overlap named
    with the reason (a pipeline)."""
    argv = ["bench", "--target", "v5e:2x4", "--strategies", "DP,PP 1F1B×DP×TP", "--overlap",
            "--json", *SMALL]  # fmt: skip
    assert cli.main(argv) == 0
    rows = {row["strategy"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"DP +overlap", "PP 1F1B×DP×TP (no overlap: --pp, --remat)"}
    assert rows["DP +overlap"]["shardkit"]["contract_ok"]
    assert rows["DP +overlap"]["shardkit"]["hidden_fraction"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "v5e:2x4", "--chip"], "--target compiles the strategies for a TPU slice"),
        (["--tpu-flags", "maxtext"], "TPU compiler's flags: it needs --target"),
    ],
)
def test_bench_target_flag_errors(capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plain_tp_overlap_hides_its_all_reduces_beside_the_other_half_batch(capsys):
    """Plain TP with --overlap compiled for v5e:2x4 (Ti/16 with 8 heads, 3 layers, scanned,
    data=4 × model=2): each region's all-reduce runs once per half-batch as an exchange and an
    all-gather, which the compiler schedules beside the other half's matmuls: 79% of the
    model axis's bytes hidden here (ViT-B/16: docs/strategies/overlap.md), against none for
    plain TP's all-reduces; both hold their contracts exactly (the same TP bytes; DP's per-layer
    buckets pad to whole tiles)."""
    argv = ["--variant", "Ti/16", "--depth", "3", "--dtype", "bfloat16", "--mesh",
            "data=4,model=2", "--heads", "8", "--batch", "64"]  # fmt: skip
    plain, overlapped = (inspect_json(capsys, *argv, *extra) for extra in ([], ["--overlap"]))
    for report in (plain, overlapped):
        assert report["contract_ok"] and report["ratio"] == 1.0, report["mismatches"]
    assert plain["overlapped_by_axes"].get("model", 0.0) == 0.0
    assert overlapped["overlapped_by_axes"]["model"] > 0.7
