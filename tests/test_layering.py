"""The layer rules of DESIGN.md, checked on the source: every import of every
module under mstar/ (top level, inside functions, under TYPE_CHECKING, and
`importlib.import_module` of a literal) against what its layer may import.

A TYPE_CHECKING import counts like any other: a layer that may not depend on
another may not name it in its annotations either.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mstar"
LEAVES = frozenset({"mstar.types", "mstar.config", "mstar.errors", "mstar.graph", "mstar.placement"})
LEAF_PACKAGES = ("mstar.graph",)  # a leaf that is a package: its modules are leaves too
# What http may reach: the Engine's public API, the leaves, and itself.
HTTP_ALLOWED = LEAVES | {"mstar", "mstar.engine", "mstar.engine.engine"}


def leaf(name: str) -> bool:
    return name in LEAVES or under(name, *LEAF_PACKAGES)
# Modules that promise to import without torch (the leaves, the scheduler, the client side of http, the SDK).
# request parsing must stay usable by clients that have no torch
TORCH_FREE = sorted(LEAVES) + ["mstar.scheduler", "mstar.http.text.protocol", "mstar.http.fields",
                              "mstar.http.text.chat_messages", "mstar.http.speech.audio", "mstar.http.speech.protocol",
                              "mstar.client", "mstar.cluster"]


ENGINE_ROOMS = ("mstar.engine.engine", "mstar.engine.messages", "mstar.engine.eventloop", "mstar.engine.worker",
                "mstar.engine.execution", "mstar.engine.memory", "mstar.engine.movement")
# the row state a step runs over (the worker owns it; execution reads and advances it)
EXECUTION_READS = frozenset({"mstar.engine.worker.rows", "mstar.engine.worker.kv_rows",
                             "mstar.engine.worker.groups.loop_group", "mstar.engine.worker.groups.group_shape"})


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Rule:
    layer: Callable[[str], bool]       # which importing modules the rule covers
    forbidden: Callable[[str], bool]   # which imported names it refuses
    why: str


RULES = (
    Rule(leaf,
         lambda n: under(n, "mstar") and not (leaf(n) or n == "mstar"),
         "leaf modules import no mstar module but each other"),
    Rule(lambda m: under(m, "mstar.scheduler"),
         lambda n: under(n, "mstar.engine", "mstar.models", "mstar.kernels", "mstar.http", "torch"),
         "scheduler/ is pure Python: no engine, models, kernels, http or torch"),
    Rule(lambda m: under(m, "mstar.kernels"),
         lambda n: under(n, "mstar") and not (leaf(n) or n == "mstar" or under(n, "mstar.kernels")),
         "kernels/ imports only torch, triton and the leaves: never engine, models, scheduler or http"),
    Rule(lambda m: under(m, "mstar.models"),
         lambda n: under(n, "mstar.engine", "mstar.scheduler"),
         "models/ never imports engine/ or scheduler/"),
    Rule(lambda m: under(m, "mstar.http"),
         lambda n: under(n, "mstar") and not (n in HTTP_ALLOWED or leaf(n) or under(n, "mstar.http")),
         "http/ talks only to the Engine's public API (mstar.engine, mstar.engine.engine)"),
    # the engine's rooms follow its threads: what one room may know of the others
    Rule(lambda m: under(m, "mstar.engine.memory", "mstar.engine.movement"),
         lambda n: under(n, *(r for r in ENGINE_ROOMS if r not in ("mstar.engine.memory", "mstar.engine.movement"))),
         "engine/memory/ and engine/movement/ hold pages, caches and tensors: they know no room that uses them"),
    Rule(lambda m: under(m, "mstar.engine.execution"),
         lambda n: under(n, "mstar.engine.eventloop", "mstar.engine.engine", "mstar.engine.messages")
         or (under(n, "mstar.engine.worker") and n not in EXECUTION_READS),
         "engine/execution/ runs steps on the worker thread: it reads the rows it runs, never the worker loop "
         "or the event loop's side"),
    Rule(lambda m: under(m, "mstar.engine.eventloop"),
         lambda n: under(n, "mstar.engine.execution", "mstar.engine.memory", "mstar.engine.movement"),
         "engine/eventloop/ never touches execution, device memory or transfers: it hears from workers"),
    Rule(lambda m: under(m, "mstar.engine.worker"),
         lambda n: under(n, "mstar.engine.eventloop", "mstar.engine.engine"),
         "engine/worker/ talks to the event loop only through engine/messages.py"),
    # the front proxies replicas that may run anywhere: it knows them only through HTTP
    Rule(lambda m: under(m, "mstar.cluster"),
         lambda n: under(n, "torch") or (under(n, "mstar") and not under(n, "mstar.cluster") and n != "mstar"),
         "cluster/ reaches replicas over HTTP only: it imports no other mstar module, and no torch"),
    # the SDK installs where torch may not: it knows the server only through HTTP
    Rule(lambda m: under(m, "mstar.client"),
         lambda n: under(n, "torch") or (under(n, "mstar") and not under(n, "mstar.client") and n != "mstar"),
         "client/ speaks HTTP only: it imports no other mstar module, and no torch"),
)


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _base(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name a (possibly relative) `from` import starts from."""
    if level == 0:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def imported_names(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(absolute imported module, line) for every import in the source.

    `from pkg import name` names `pkg.name` when that is a known module, else `pkg`.
    """
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.append((node.args[0].value, node.lineno))
    return found


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return (name in ("import_module", "__import__") and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str))


def violations(source: str, module: str, is_package: bool, known: set[str]) -> list[str]:
    """One message per import of `module` that breaks a rule."""
    out = []
    for name, line in imported_names(source, module, is_package, known):
        for rule in RULES:
            if rule.layer(module) and rule.forbidden(name):
                out.append(f"{module}:{line} imports {name} ({rule.why})")
    return out


def test_layer_rules_hold() -> None:
    modules = module_names()
    known = set(modules)
    problems = []
    for module, path in modules.items():
        problems += violations(path.read_text(), module, path.name == "__init__.py", known)
    assert not problems, "layer rules broken:\n" + "\n".join(problems)


KNOWN = {"mstar", "mstar.types", "mstar.errors", "mstar.graph", "mstar.engine", "mstar.engine.engine",
         "mstar.engine.worker", "mstar.scheduler", "mstar.scheduler.pages", "mstar.http", "mstar.http.app",
         "mstar.kernels", "mstar.kernels.norm", "mstar.models", "mstar.models.layers"}


@pytest.mark.parametrize("module, is_package, source, expected", [
    ("mstar.graph", False, "from mstar.engine import worker", "mstar.engine.worker"),
    ("mstar.graph", False, "def f():\n    from .scheduler import pages", "mstar.scheduler.pages"),
    ("mstar.scheduler.pages", False, "import torch.nn", "torch.nn"),
    ("mstar.scheduler.pages", False,
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import worker", "mstar.engine.worker"),
    ("mstar.models.llama.model", False, "import importlib\nimportlib.import_module('mstar.scheduler')",
     "mstar.scheduler"),
    ("mstar.http", True, "from .. import engine\nfrom ..engine import worker", "mstar.engine.worker"),
    ("mstar.http.app", False, "from mstar.scheduler.pages import PagePool", "mstar.scheduler.pages"),
    ("mstar.kernels.norm", False, "from mstar.models.layers import RMSNorm", "mstar.models.layers"),
    ("mstar.kernels.norm", False, "def f():\n    from ..engine import worker", "mstar.engine.worker"),
    ("mstar.kernels", True, "from mstar.scheduler import pages", "mstar.scheduler.pages"),
    ("mstar.scheduler.pages", False, "from mstar.kernels.norm import rms_norm", "mstar.kernels.norm"),
    ("mstar.client.results", False, "from mstar.types import SamplingParams", "mstar.types"),
    ("mstar.client.audio", False, "def f():\n    import torch", "torch"),
    ("mstar.engine.memory.kv_cache", False, "from mstar.engine.worker.rows import PartitionRun",
     "mstar.engine.worker.rows"),
    ("mstar.engine.execution.runner", False, "from mstar.engine.worker.walker import Walker",
     "mstar.engine.worker.walker"),
    ("mstar.engine.eventloop.requests", False, "from mstar.engine.memory import kv_cache", "mstar.engine.memory"),
    ("mstar.engine.worker.walker", False, "from mstar.engine.eventloop.requests import RequestState",
     "mstar.engine.eventloop.requests"),
])
def test_checker_flags_violations(module: str, is_package: bool, source: str, expected: str) -> None:
    found = violations(source, module, is_package, KNOWN)
    assert len(found) == 1 and f" imports {expected} " in found[0], found


def test_checker_accepts_allowed_imports() -> None:
    http = textwrap.dedent("""
        from mstar.engine import Engine
        from mstar.engine.engine import Engine
        from mstar import types, errors
        from . import app
        import aiohttp
    """)
    assert violations(http, "mstar.http.server", False, KNOWN) == []
    leaf = "from mstar.errors import WalkError\nif TYPE_CHECKING:\n    import torch\n    from mstar.types import X"
    assert violations(leaf, "mstar.graph", False, KNOWN) == []
    kernels = "import torch\nimport triton\nfrom mstar.types import Rotary\nfrom mstar.kernels import norm"
    assert violations(kernels, "mstar.kernels.rope_kv", False, KNOWN) == []
    # models/ and engine/ may both build on kernels/
    assert violations("from mstar.kernels.norm import rms_norm", "mstar.models.layers.norm", False, KNOWN) == []
    client = "import aiohttp\nfrom mstar.client.errors import MstarError\nfrom . import results"
    assert violations(client, "mstar.client.streams", False, KNOWN) == []


# Raises on any import of torch, so a module that needs it fails to import.
_BLOCK_TORCH = textwrap.dedent("""
    import importlib, importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked: {name}")
            return None

    sys.meta_path.insert(0, NoTorch())
    importlib.import_module(sys.argv[1])
""")


def _import_without_torch(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH, module], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module: str) -> None:
    assert module in module_names()
    result = _import_without_torch(module)
    assert result.returncode == 0, f"{module} needs torch:\n{result.stderr}"


def test_torch_blocker_blocks() -> None:
    result = _import_without_torch("torch")
    assert result.returncode != 0 and "torch is blocked" in result.stderr
