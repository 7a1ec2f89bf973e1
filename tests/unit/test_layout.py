"""The layout shows the architecture: a package under ``services/`` (a service: stage server,
trainer, coordinator, simulator) imports ``shared`` and itself, never another service nor a
command module beside it. The commands at ``services/`` top level (``swarm up``, ``swarm
export``, ...) compose the services and may import them. Read from the source's import
statements (every form, at any depth), so that a sideways import inside a function counts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"


def service_packages() -> list[str]:
    return sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file())


def imported_modules(path: Path) -> set[str]:
    """Absolute module names that ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(SERVICES.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from services import trainer`
    return found


def sideways_imports() -> list[str]:
    packages = service_packages()
    commands = {p.stem for p in SERVICES.glob("*.py") if p.stem != "__init__"}
    bad = []
    for package in packages:
        for path in sorted((SERVICES / package).rglob("*.py")):
            for module in sorted(imported_modules(path)):
                parts = module.split(".")
                if len(parts) < 2 or parts[0] != "services" or parts[1] == package:
                    continue
                if parts[1] in packages or parts[1] in commands:
                    bad.append(f"{path.relative_to(SERVICES.parent)} imports {module}")
    return bad


def test_the_services_are_the_packages_we_expect():
    # the check below means nothing if it finds no packages to check
    assert {"coordinator", "stage_server", "trainer", "simulator"} <= set(service_packages())


def test_no_service_imports_another_service_sideways():
    assert sideways_imports() == []


def test_the_import_reader_sees_every_form(tmp_path, monkeypatch):
    pkg = tmp_path / "services" / "alpha"
    pkg.mkdir(parents=True)
    (tmp_path / "services" / "beta").mkdir()
    for init in (
        pkg / "__init__.py",
        tmp_path / "services" / "beta" / "__init__.py",
        tmp_path / "services" / "__init__.py",
    ):
        init.write_text("")
    (tmp_path / "services" / "tool.py").write_text("")
    (pkg / "m.py").write_text(
        "import services.beta.x\n"
        "from services import tool\n"
        "from ..beta import y\n"
        "from . import own\n"
        "def f():\n"
        "    from services.beta.z import g\n"
        "from shared import codec\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "SERVICES", tmp_path / "services")
    assert sideways_imports() == [
        "services/alpha/m.py imports services.beta",
        "services/alpha/m.py imports services.beta.x",
        "services/alpha/m.py imports services.beta.y",
        "services/alpha/m.py imports services.beta.z",
        "services/alpha/m.py imports services.beta.z.g",
        "services/alpha/m.py imports services.tool",
    ]


def public_names(path: Path) -> list[str]:
    """The names a module defines at its top level that do not start with an underscore."""
    names = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


def step_path_table() -> list[tuple[str, int]]:
    """(file, public names) of each row of ``docs/architecture.md``'s "The files of one global step"."""
    text = (SERVICES.parent / "docs" / "architecture.md").read_text()
    section = text[text.index("**The files of one global step**") :]
    rows = []
    for line in section.splitlines()[4:]:
        if not line.startswith("| "):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].isdigit():
            file, _, count = cells[1].partition(" (")
            rows.append((file.strip("`"), int(count.rstrip(")"))))
    return rows


def test_a_global_step_visits_at_most_six_files_each_with_at_most_20_public_names():
    """Issue 27: the files of one global step, as the architecture lists them, are at most six,
    each listed once; the counts the table gives are the modules' own."""
    rows = step_path_table()
    files = [f for f, _ in rows]
    assert 1 <= len(files) <= 6 and len(set(files)) == len(files), files
    for file, count in rows:
        names = public_names(SERVICES.parent / file)
        assert len(names) == count <= 20, (file, count, names)
