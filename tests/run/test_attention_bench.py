"""``shardkit bench --attention`` (``run.attention_bench``): the zigzag device's share computes
its rows of attention and their gradients exactly, every row is measured against a float32
reference, and bad flags are one line. The Pallas rows run in Pallas' interpreter here."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit import cli
from shardkit.parallel.sequence import layouts
from shardkit.run import attention_bench as ab


def test_a_zigzag_device_computes_its_rows_and_their_gradients():
    """Device 1 of a causal zigzag ring of 2 over 512 tokens (float32): its output rows and the
    gradients of a loss on them equal the reference's, q's on its rows, k's and v's everywhere."""
    ring, device, tokens = 2, 1, 512
    t = tokens // ring
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (layouts.to_layout(jax.random.normal(key, (1, tokens, 4, 32)), ring, "zigzag")
               for key in keys[:3])  # fmt: skip
    d_out = jax.random.normal(keys[3], (1, t, 4, 32))
    mine = slice(device * t, (device + 1) * t)

    def reference_share(q, k, v):  # the reference in position order, then this device's rows
        whole = ab.reference(*(layouts.from_layout(x, ring, "zigzag") for x in (q, k, v)), True)
        return layouts.to_layout(whole, ring, "zigzag")[:, mine]

    step = ab.zigzag_device_step(ring, device, tokens)
    out, vjp = jax.vjp(step, q[:, mine], k, v)
    want, want_vjp = jax.vjp(reference_share, q, k, v)
    np.testing.assert_allclose(out, want, atol=1e-5)
    (dq, dk, dv), (want_dq, want_dk, want_dv) = vjp(d_out), want_vjp(d_out)
    for got, ref in ((dq, want_dq[:, mine]), (dk, want_dk), (dv, want_dv)):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    assert not jnp.any(want_dq[:, :t])  # the other device's queries: nothing of this share


def test_bench_attention_rows(capsys, tmp_path):
    """Every contender runs at 256 tokens; the zigzag devices do half the causal work and agree
    with the reference as closely as splash does (bfloat16 outputs)."""
    png = tmp_path / "attention.png"
    argv = ["bench", "--attention", "--tokens", "256", "--ring", "2", "--kernel", "pallas"]
    assert cli.main([*argv, "--steps", "1", "--warmup", "0", "--json", "--plot", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["contender"], r["causal"]): r for r in result["rows"]}
    assert set(rows) == {
        *((name, causal) for name in ("xla", "splash", "shardkit pallas") for causal in (0, 1)),
        ("zigzag 0/2", True),
        ("zigzag 1/2", True),
    }
    assert all(r["error"] is None and r["ms"] > 0 for r in rows.values()), result["rows"]
    for name in ("zigzag 0/2", "zigzag 1/2", "shardkit pallas"):
        assert rows[name, True]["max_diff"] <= rows["splash", True]["max_diff"] + 1e-6
    assert result["shape"] == ab.SHAPE and result["ring"] == 2 and png.stat().st_size > 0
    table = ab.format_table(result)
    assert "Pallas rows interpreted" in table and "zigzag 1/2" in table


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ring", "3", "--tokens", "100"], "100 tokens do not split over a zigzag ring of 3"),
        (["--ring", "0", "--tokens", "512"], "--ring takes a device count >= 1"),
        (["--tokens", "4k"], "--tokens takes positive integers"),
        (["--dim", "64"], "--attention times one device's attention"),
        (["--mesh", "data=2"], "--attention times one device's attention"),
        (["--model", "gpt"], "--attention times attention alone"),
    ],
)
def test_bench_attention_refuses_bad_flags(flags, message, capsys):
    assert cli.main(["bench", "--attention", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
