"""The floors of the code, read from its import statements: each folder imports only the
floors below it (DESIGN.md's layering), and no module basename is used twice."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder (dotted) -> top-level project packages (or sub-packages) it must never import
FORBIDDEN = {
    "parallel": ("engine", "launcher", "report", "bench"),
    "engine": ("launcher", "report", "bench"),
    "engine.rank": ("engine.driver", "engine.transfer", "engine.llm"),
    "engine.loading": ("engine.rank", "engine.driver", "engine.transfer", "engine.llm"),
    "engine.driver": ("engine.transfer", "engine.llm"),
    "report": ("launcher", "bench"),
    "launcher": ("bench",),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def test_imports_point_down_only():
    wrong = []
    for package, forbidden in FORBIDDEN.items():
        for path in _modules(package):
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check above can fail: a module importing upward is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from engine.driver.scheduler import Scheduler\nimport launcher.generate\n")
    assert {"engine.driver.scheduler", "launcher.generate"} <= _imports(bad)


def test_no_basename_twice():
    names = Counter(p.name for pkg in ("engine", "parallel", "launcher", "report", "bench")
                    for p in _modules(pkg) if p.name not in ("__init__.py", "__main__.py"))
    assert [n for n, c in names.items() if c > 1] == []
