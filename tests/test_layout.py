"""The layout's rules (docs/design.md), held: imports point down the layers only, ``import
shardkit`` loads no runner and no hypothesis, modules and functions stay small, and the ring
byte formulas exist once."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardkit"
# room -> the shardkit rooms it must not import (``vit_ref`` is listed as a room too).
FORBIDDEN = {
    "mesh": ("parallel", "comm", "models", "run", "cli", "testing", "vit_ref"),
    "parallel": ("comm", "models", "run", "cli", "testing", "vit_ref"),
    "comm": ("parallel", "kernels", "models", "run", "cli", "testing", "vit_ref"),
    "kernels": ("parallel", "comm", "models", "run", "cli", "testing", "vit_ref"),
    "models": ("run", "cli"),
    "run": ("cli",),
    "cli": ("models", "comm", "parallel", "vit_ref"),
    "testing": ("models", "comm", "run", "cli", "vit_ref"),
}


def _room(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_rooms(path: pathlib.Path) -> set[str]:
    """The shardkit rooms (and ``vit_ref``) a module imports, at any depth of its code."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "shardkit":  # from shardkit import parallel, ...
                names = [f"shardkit.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "vit_ref":
                rooms.add("vit_ref")
            elif parts[0] == "shardkit" and len(parts) > 1:
                rooms.add(parts[1])
    return rooms


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path: pathlib.Path) -> None:
    room = _room(path)
    wrong = _imported_rooms(path) & set(FORBIDDEN.get(room, ()))
    assert not wrong, f"{path.relative_to(ROOT)} ({room}) imports {sorted(wrong)}"


def test_import_shardkit_loads_no_runner_and_no_hypothesis() -> None:
    code = (
        "import shardkit, sys; "
        "bad = [m for m in sys.modules if m == 'hypothesis' or m.startswith('shardkit.run')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path: pathlib.Path) -> None:
    text = path.read_text()
    assert text.count("\n") <= 600, f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length}"


def test_the_ring_formulas_are_written_once() -> None:
    """``2 * (n - 1) / n`` and ``(n - 1) / n`` appear only in ``comm/bytes.py``."""
    for path in MODULES:
        if path == PACKAGE / "comm" / "bytes.py":
            continue
        text = path.read_text()
        assert "(n - 1) / n" not in text, f"{path.relative_to(ROOT)} re-derives a ring formula"
