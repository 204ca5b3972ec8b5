"""``shardkit inspect``: the communication ledger of one plan's compiled train step, beside its
contract, as a table or JSON, with the HLO text and a picture on request.

The work is ``models.vit.report.inspect`` (compile, measure, compare); this module adds the
command's outputs. Across processes (``shardkit launch``) only process 0 writes files.
"""

from __future__ import annotations

import json
import pathlib

import jax

from shardkit.models.vit import ShardedViT, report


def run(
    model: ShardedViT,
    batch: int,
    *,
    as_json: bool = False,
    hlo_path: str | pathlib.Path | None = None,
    plot_path: str | pathlib.Path | None = None,
) -> str:
    """The report of ``model``'s step as the command prints it (a table, or one JSON object);
    writes the compiled HLO to ``hlo_path`` and the picture to ``plot_path`` when given."""
    lead = jax.process_index() == 0  # across processes, files come from process 0 only
    result = report.model_inspect(model, batch, hlo_path=hlo_path if lead else None)
    if plot_path and lead:
        from shardkit.comm.plot import plot_report

        plot_report(result, plot_path)
    return json.dumps(result.to_json()) if as_json else result.format()
