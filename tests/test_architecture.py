"""The house's rules, checked on the code itself: the import contracts of pyproject.toml
(docs/architecture.md, "Layers"), no function longer than a screen, and a product that speaks of
itself only (no development-process words, no machine paths in what users read)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("detector", "training", "service")
MAX_FUNCTION_LINES = 80
# What users read: the packages (code, presets, the page), the benchmarks and reference
# scripts, the documents.
READ_BY_USERS = (*PACKAGES, "benchmarks", "references", "docs", "docker", "README.md", "Makefile")
PROCESS_WORDS = re.compile(
    r"\bsessions? [0-9]|\bissues? [0-9]|\bissue's\b|\(issue\b|(?-i:RESULTS\.md)", re.IGNORECASE
)
MACHINE_PATHS = re.compile(r"(?<![\w.])/(?:work|root)/\w")
TEXT_SUFFIXES = {".py", ".md", ".json", ".js", ".html", ".css", ".toml", ".yml", ".yaml", ""}


def _lint_imports() -> Path:
    return Path(sys.executable).parent / "lint-imports"


def _python_files() -> list[Path]:
    return sorted(
        p
        for folder in (*PACKAGES, "benchmarks", "references")
        for p in (ROOT / folder).rglob("*.py")
    )


def _user_text_files() -> list[Path]:
    files: list[Path] = []
    for name in READ_BY_USERS:
        path = ROOT / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in found if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def test_the_import_contracts_hold() -> None:
    """Layers of the top-level packages and of training/'s subpackages, and no training extra
    in what a served bundle imports (pyproject.toml's [tool.importlinter])."""
    if not _lint_imports().is_file():
        pytest.fail("lint-imports is missing: `make setup` installs it (the dev extra)")
    done = subprocess.run(
        [str(_lint_imports()), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_subpackage_of_training_is_in_a_layer() -> None:
    """A new subpackage joins the layers contract; otherwise nothing checks its imports."""
    config = (ROOT / "pyproject.toml").read_text()
    layered = set(re.findall(r"training\.(\w+)", config))
    packages = {p.parent.name for p in (ROOT / "training").glob("*/__init__.py")}
    modules = {p.stem for p in (ROOT / "training").glob("*.py")} - {"__init__"}
    assert packages | modules <= layered, sorted((packages | modules) - layered)


def test_no_function_is_longer_than_a_screen() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
        for path in _python_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (lines := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_the_product_speaks_of_itself_only() -> None:
    """No development-process words (a user has no issue 11 and no session 58) and no path of a
    development machine in the code, presets, page, benchmarks or documents."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in _user_text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if PROCESS_WORDS.search(line) or MACHINE_PATHS.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line", ["fixed in session 58", "see issue 11", "the issue's preset", "benchmarks/RESULTS.md"]
)
def test_the_words_check_finds_process_words(line: str) -> None:
    assert PROCESS_WORDS.search(line)


def test_the_words_check_leaves_the_products_own_words() -> None:
    for line in ("an HTTP session", "a progress bar", "issues a request", "/v1/predict"):
        assert not PROCESS_WORDS.search(line) and not MACHINE_PATHS.search(line)


# The serve-only install (`pip install '.[serve]'`) has none of the train/attacks extras.
_WITHOUT_TRAINING_EXTRAS = """
import sys
from importlib.abc import MetaPathFinder

class Absent(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"art", "pyautoattack", "matplotlib"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Absent())
from training.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["serve", "score"])
def test_serving_commands_run_without_the_training_extras(command: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRAINING_EXTRAS, command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: lapguard {command}" in done.stdout
