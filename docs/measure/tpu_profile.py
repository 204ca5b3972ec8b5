"""Where one chip's train-step time goes, op by op: big_vision's recipe beside vit_ref variants.

Each step (``bigvision``, or a ``tpu_vit_variants.py`` option string such as
``loop,remat=none,res=bf16``) is compiled, warmed up, then traced for ``--steps`` steps with
``jax.profiler``; the trace's device plane is read back with ``jax.profiler.ProfileData`` and
every XLA op's time is summed by the source operation it runs: a fusion is named by the
``op_name`` metadata of the matmul inside it (``MM``) or else of its root (``EW``), with the
layer index dropped, so the 12 layers' copies of one operation add up. Prints the device time
per step and the top operations; with ``--out DIR`` also writes each step's optimized HLO
(``DIR/NAME.hlo.txt``) and its per-op times (``DIR/NAME.ops.json``) to read against it.

    python docs/measure/tpu_profile.py --batch 32 --out $OUT bigvision loop,remat=none,res=bf16
"""

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

import jax

import vit_ref

sys.path.insert(0, os.path.dirname(__file__))
import tpu_vit_variants


def build(name, cfg, batch):
    if name == "bigvision":
        import tpu_bigvision  # needs flax

        return tpu_bigvision.step_and_args(cfg, batch)
    opts = dict(o.split("=") if "=" in o else (o, "1") for o in name.split(",") if o != "base")
    return tpu_vit_variants.step_and_args(cfg, batch, opts)


def device_ops(trace_dir):
    """{op's HLO text: [total ns, count, category, long name]} from the first device plane's
    XLA ops (the trace names each op by its HLO instruction)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    if not planes:
        raise SystemExit(f"no device plane in the trace: {[p.name for p in data.planes]}")
    ops = {}
    if not any(line.name == "XLA Ops" for line in planes[0].lines):
        names = [x.name for x in planes[0].lines]
        raise SystemExit(f"no 'XLA Ops' line in {planes[0].name}: {names}")
    for line in planes[0].lines:
        if line.name != "XLA Ops":
            continue
        for event in line.events:
            stats = dict(event.stats)
            row = ops.setdefault(event.name, [0, 0, "", ""])
            row[0] += event.duration_ns
            row[1] += 1
            row[2] = str(stats.get("hlo_category", ""))
            row[3] = str(stats.get("long_name", ""))[:160]
    return ops


def computations(hlo):
    """{computation name: its body text} of an HLO module's text."""
    bodies, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), []
        elif line.startswith("}"):
            if name:
                bodies[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return bodies


def source_op(op_text, bodies, lines_by_name):
    """'MM <op_name>' for a fusion holding a matmul, 'EW <op_name>' for another fusion (its
    root's), 'OP <op_name or HLO name>' otherwise; layer indices and jit wrappers dropped."""
    meta = lambda line: (re.search(r'op_name="([^"]+)"', line) or [None, None])[1]  # noqa: E731
    name = re.match(r"%([\w.\-]+)", op_text).group(1)
    called = re.search(r"calls=%([\w.\-]+)", op_text)
    body = bodies.get(called.group(1), "") if called else ""
    label = None
    for line in body.splitlines():
        if "convolution(" in line:
            label = f"MM {meta(line)}"
            break
    else:
        roots = [meta(x) for x in body.splitlines() if x.strip().startswith("ROOT") and meta(x)]
        if roots:
            label = f"EW {roots[-1]}"
    if label is None:
        bare = re.sub(r"[.\d]+$", "", name)
        label = f"OP {meta(lines_by_name.get(name, '')) or bare}"
    label = re.sub(r"Block_\d+", "Block", label)
    return re.sub(r"jit\(step\)/|while/body/|closed_call/|checkpoint/|rematted_computation/", "",
                  label)  # fmt: skip


def profile(name, cfg, batch, steps, out):
    step, args = build(name, cfg, batch)
    compiled = step.lower(*args).compile()
    params, state, *data = args
    for _ in range(3):
        params, state, metrics = compiled(params, state, *data)
    jax.block_until_ready(metrics)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            params, state, metrics = compiled(params, state, *data)
        jax.block_until_ready(metrics)
    ops = device_ops(trace_dir)
    total = sum(r[0] for r in ops.values()) / steps / 1e6
    print(f"\n== {name}, batch {batch}: device time {total:.2f} ms/step "
          f"({batch / total * 1e3:.0f} img/s if nothing else ran)")  # fmt: skip
    hlo = compiled.as_text()
    bodies = computations(hlo)
    lines_by_name = {m.group(1): line for line in hlo.splitlines()
                     if (m := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line))}  # fmt: skip
    by_source, count = collections.Counter(), collections.Counter()
    for op, (t, n, _, _) in ops.items():
        key = source_op(op, bodies, lines_by_name)
        by_source[key] += t / steps / 1e6
        count[key] += n // steps
    for key, t in by_source.most_common(30):
        print(f"  {t:7.3f} ms  x{count[key]:<4} {key[:120]}")
    if out:
        safe = name.replace(",", "_").replace("=", "-")
        with open(f"{out}/{safe}_b{batch}.hlo.txt", "w") as f:
            f.write(hlo)
        with open(f"{out}/{safe}_b{batch}.ops.json", "w") as f:
            json.dump({k: v for k, v in ops.items()}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    cfg = vit_ref.variant("B/16", dtype="bfloat16", pool="gap", head_zeroinit=False)
    for name in args.names:
        profile(name, cfg, args.batch, args.steps, args.out)


if __name__ == "__main__":
    main()
