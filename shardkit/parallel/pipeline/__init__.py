"""Pipeline parallelism: schedules as data, their tables, and the engine that runs them.

Eight modules: ``schedules`` (GPipe, 1F1B, interleaved, ZB-H1, ZB-V as grids of actions, and
their uniform and phased forms), ``tables`` (a schedule compiled into static int32 tables:
actions and buffer slots), ``split`` (a chunk's backward cut into its input-gradient and
weight-gradient halves), ``chunk`` (how the engine calls a chunk: side inputs, an aux loss's
gradient, its metrics), ``writes`` (what a tick's branch writes, and the buffer helpers),
``sends`` (how a tick's outputs travel: ppermutes, switched by tick where ZBV's V needs two),
``engine`` (``pipeline_grads``: the traced scan over those tables inside ``shard_map``) and
``forward`` (``pipeline_forward``: the forwards alone, for inference). This package
re-exports their public names.

Model-agnostic: a chunk is any ``stage_fn(chunk_params, x) -> y`` with y typed like x (with
``side``: ``stage_fn(chunk_params, x, side_m)``, microbatch m's side inputs, e.g. segment ids;
with ``aux``: it returns ``(y, aux_loss)``, a scalar added to the loss with its gradient); an
``Ends`` holds what comes before chunk 0 (``embed_fn(embed_params, input) -> x``) and after the
last chunk (``loss_fn(loss_params, y, target) -> scalar``; ``tied`` keys read by both). Per
device s of the ``stage`` axis (S devices, V chunks each: chunk v·S + s; ZB-V: s and 2S−1−s):

  stage_params[V, ...]   this device's chunks      inputs[M, ...]   per microbatch (stage 0)
  embed / loss params    replicated over stage     targets[M, ...]  per microbatch (stage S−1)

``pipeline_grads`` scans the schedule's ticks. Each tick a device runs its table entry:

  F  y, vjp = jax.vjp(stage_fn, p[v], x), x embedded (chunk 0) or from the inbox; the vjp's
     residuals (all but the params, which stay where they are) go to a stash slot; y is sent
     to the next stage (``ppermute`` +1); on the last chunk the loss and dy = ∂loss/∂y are
     taken at once and dy goes to this device's own cotangent inbox.
  B  the vjp rebuilt from the stash, applied to dy from the inbox: dx is sent to the previous
     stage (−1); unsplit schedules take the weight gradient here too (chunk 0: and the
     embedding's, by its vjp re-run on the microbatch's input). Split schedules (ZB-H1) run
     only the backward's input-gradient half (``split.SplitBackward``: the equations dx
     depends on) and put what the other half reads (the cotangents at each weight's use, and
     dx) in a W-stash slot.
  W  (split schedules) the other half, from the W stash, the residuals and dy: the weight
     gradients only. No equation runs in both, so ZB-H1's step does 1F1B's matmuls (the
     compiled count: ``comm.ledger.Ledger.flops``), not one more backward per microbatch.

Three forms run a schedule (``Schedule.form``). The branch form (the builders' tables): each
tick every stage runs its own action as one ``lax.switch`` branch, idle ticks compute
nothing, and a collective inside a chunk (or the embedding, or the loss) runs only on the
stages that take its branch. That is
sound for a collective whose device groups lie within one stage (``psum``, ``all_gather``,
``psum_scatter``, ``all_to_all`` over ``model``, ``seq`` or ``expert``: TP, Ulysses, MoE), not for a
``ppermute``: XLA's collective-permute is one instruction over every device of the program,
across all stages (measured on jax 0.10.2 CPU: wrong values or a rendezvous abort,
``docs/measure/permute_in_branch.py``). So when a chunk, the embedding or the loss runs a
``ppermute`` (ring attention), the engine runs the uniform form (``schedules.uniform``): the
schedule re-timed into super ticks of fixed phases (F, B, then W if split); every device runs
each phase some stage runs, with the same switch index (``Tables.variants``), on its own table
entry, and masks what is not its own. Every collective then runs on every device at the same
point; the price is the masked compute (``chunk_runs`` counts what each device runs). The
phased form (``schedules.phased``) takes the uniform form's super ticks with the branch form's
per-stage branches: each phase, every stage runs its own action or nothing. Where the
branch form pairs one stage's F with its neighbour's B in one lock-step tick (which then
costs a B), a phased super tick runs an F and a B on every stage; the models run 1F1B,
interleaved, ZB-H1 and ZBV in it when no chunk holds a ``ppermute`` (GPipe stays branch).

Buffers hold only what the schedule keeps in flight: the stash, the activation inbox, the
cotangent inbox and the W stash each have as many slots as the busiest stage's most
simultaneously live entries (``tables``: slots assigned statically by interval colouring), so
1F1B's stash has S slots whatever M is, while GPipe's has M. The SPMD program is the same on
every device, so every device allocates the busiest stage's slots. In the branch form idle
ticks compute nothing (``lax.switch`` to an identity branch); buffers start at zeros and no
unwritten slot is ever read (the ``poison`` test; in the uniform form, no masked result is
ever kept). The scan is split into segments by send pattern
(``Tables.segments``: the steady state, from the first cotangent send to the last activation
send, is one segment that sends both ways), and each tick of a segment runs one ``ppermute`` of
one microbatch activation in each direction it uses; a segment compiles only the branches it
runs. Collectives and matmuls inside a branch carry the segment's and the branch's named
scopes, so a ledger can count them per stage (``branch_runs``, ``staged.stage_ledger``).

No buffer goes through a branch. A branch reads the buffers and returns its writes (per
buffer a slot and a value, per accumulator what to add), applied after the switch: XLA's
copy insertion copies whole every buffer a ``lax.switch`` takes in and hands back (the idle
branch aliases it), so that form copied the whole stash, the inboxes and the gradients every
tick (bench's ViT, ``--mesh stage=2 --microbatches 8``: 174 MB per GPipe forward tick, 60 MB
per interleaved steady tick; now under 1 MB).
"""

from shardkit.parallel.pipeline import schedules
from shardkit.parallel.pipeline.engine import Ends, pipeline_grads
from shardkit.parallel.pipeline.forward import pipeline_forward
from shardkit.parallel.pipeline.tables import (
    BRANCH_SCOPE,
    SEGMENT_SCOPE,
    ForwardTables,
    Tables,
    branch_runs,
    chunk_runs,
    forward_tables,
    layer_order,
    tables,
)

__all__ = [
    "BRANCH_SCOPE",
    "SEGMENT_SCOPE",
    "Ends",
    "ForwardTables",
    "Tables",
    "branch_runs",
    "chunk_runs",
    "forward_tables",
    "layer_order",
    "pipeline_forward",
    "pipeline_grads",
    "schedules",
    "tables",
]
