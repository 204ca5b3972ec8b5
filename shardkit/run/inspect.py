"""``shardkit inspect``: the communication ledger of one plan's compiled train step, beside its
contract, as a table or JSON, with the HLO text and a picture on request; with ``--target`` the
step is compiled for a TPU slice instead (``run.target``) and its memory held to the chip's HBM.

The work is ``models.vit.report.inspect`` (compile, measure, compare); this module adds the
command's outputs. Across processes (``shardkit launch``) only process 0 writes files.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import jax

from shardkit.mesh import platform as mesh_platform
from shardkit.models.vit import ShardedViT, report
from shardkit.run import target as tgt


def run(
    model: ShardedViT,
    batch: int,
    *,
    as_json: bool = False,
    hlo_path: str | pathlib.Path | None = None,
    plot_path: str | pathlib.Path | None = None,
    target: str | None = None,
    compiler_options: dict[str, str] | None = None,
) -> str:
    """The report of ``model``'s step as the command prints it (a table, or one JSON object);
    writes the compiled HLO to ``hlo_path`` and the picture to ``plot_path`` when given.

    ``target``: the TPU topology ``model``'s devices are (``run.target.topology_devices``): the
    report adds the fit to the chip's HBM, and a step that does not fit raises ``TargetError``.
    ``compiler_options``: for the compile (``run.target.TPU_FLAGS``).
    """
    lead = jax.process_index() == 0  # across processes, files come from process 0 only
    platform = mesh_platform(model.mesh)  # "tpu" under --target, or on a TPU
    try:
        with tgt.uncached() if target else contextlib.nullcontext():
            result = report.model_inspect(
                model, batch, hlo_path=hlo_path if lead else None, platform=platform,
                compiler_options=compiler_options,
            )  # fmt: skip
    except jax.errors.JaxRuntimeError as err:
        refused = target and _no_fit(err, model, batch)
        if refused:
            raise refused from None
        raise
    fit = None
    if target is not None and result.ledger.memory is not None:
        fit = tgt.fit_of(result.ledger.memory, result.ledger.hlo, _kind(model))
        if fit.fits is False:
            raise tgt.TargetError(fit.error())
    if plot_path and lead:
        from shardkit.comm.plot import plot_report

        plot_report(result, plot_path)
    if as_json:
        extra = {} if target is None else {"target": target, "fit": fit and fit.to_json()}
        return json.dumps(result.to_json() | extra)
    text = result.format()
    return text if fit is None else f"{text}\n{target}: {fit.line()}"


def _kind(model: ShardedViT) -> str:
    return str(model.mesh.devices.flat[0].device_kind)


def _no_fit(err: Exception, model: ShardedViT, batch: int) -> tgt.TargetError | None:
    """The one-sentence error when the TPU compiler refused the step for want of HBM."""
    optimizer = report.default_optimizer()
    step: Any = model.train_step(optimizer)  # a jitted function
    lowered = step.lower(*report.step_args(model, batch, optimizer)).as_text()
    return tgt.compile_error(err, lowered, _kind(model))
