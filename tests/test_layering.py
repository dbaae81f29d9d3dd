"""The layers as docs/ARCHITECTURE.md draws them, checked on the sources' imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS_PACKAGE = ROOT / "worker" / "backends" / "transformers"
HEAVY = {"torch", "transformers"}


def imported_top_levels(path: Path) -> set[str]:
    """The top-level packages ``path`` imports: import statements anywhere in it, and calls of
    ``importlib.import_module`` or ``__import__`` with a name written out."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and _imports_by_name(node.func):
            named = node.args[:1] + [keyword.value for keyword in node.keywords if keyword.arg == "name"]
            for first in named:
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value.split(".")[0])
    return names


def _imports_by_name(function: ast.expr) -> bool:
    return (isinstance(function, ast.Name) and function.id in ("__import__", "import_module")) or (
        isinstance(function, ast.Attribute) and function.attr == "import_module"
    )


def sources(*packages: str) -> list[Path]:
    """The packages' Python files; a package of none is a mistake in the test (a moved folder)."""
    found = sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))
    for package in packages:
        assert any(path.is_relative_to(ROOT / package) for path in found), f"no Python file under {package}/"
    return found


def test_only_the_transformers_package_imports_torch_or_transformers():
    outside = {
        str(path.relative_to(ROOT)): sorted(imported_top_levels(path) & HEAVY)
        for path in sources("protocol", "worker")
        if TRANSFORMERS_PACKAGE not in path.parents and imported_top_levels(path) & HEAVY
    }
    assert outside == {}, f"imports of torch or transformers outside the package: {outside}"


def test_reading_tool_calls_of_every_format_loads_neither_torch_nor_transformers():
    """What a generate with tools runs on a backend without torch (echo): the call reader."""
    program = (
        "import sys\n"
        "from protocol.methods import Tool, ToolFunction\n"
        "from worker.tool_calls import ToolCallReader\n"
        "tools = [Tool(function=ToolFunction(name='f'))]\n"
        "for format, text in [('hermes', '<tool_call>{\"name\": \"f\"}</tool_call>'),\n"
        "                     ('llama3_json', '{\"name\": \"f\", \"parameters\": {}}'),\n"
        "                     ('functiongemma', '<start_function_call>call:f{}<end_function_call>')]:\n"
        "    reader = ToolCallReader(format, tools)\n"
        "    reader.feed(text); reader.finish()\n"
        "    assert [call.name for call in reader.calls] == ['f'], reader.calls\n"
        "print(sorted(HEAVY & set(sys.modules)))\n".replace("HEAVY", repr(HEAVY))
    )
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_protocol_imports_nothing_of_the_worker():
    offenders = [str(path.relative_to(ROOT)) for path in sources("protocol") if "worker" in imported_top_levels(path)]
    assert offenders == []


def test_the_checker_sees_imports_inside_functions(tmp_path: Path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from torch import nn\n    import transformers.utils as u\n")
    assert imported_top_levels(module) == {"torch", "transformers"}


def test_the_checker_sees_imports_by_name(tmp_path: Path):
    module = tmp_path / "by_name.py"
    module.write_text("import importlib\nfrom importlib import import_module\n"
                      "def f():\n    importlib.import_module('torch.nn')\n    import_module('transformers')\n"
                      "    __import__('numpy')\n    importlib.import_module(name='safetensors')\n")
    assert imported_top_levels(module) == {"importlib", "torch", "transformers", "numpy", "safetensors"}


def test_the_checker_reads_the_worker_s_and_the_protocol_s_files():
    found = sources("protocol", "worker")
    assert ROOT / "worker" / "backends" / "transformers" / "backend.py" in found
    assert ROOT / "protocol" / "methods.py" in found and len(found) > 50


def test_the_type_check_reads_the_checkouts_own_config_under_a_directory_holding_another(tmp_path: Path):
    """A pyrightconfig.json in a directory above the checkout (one was left in /tmp) took over
    from pyproject.toml: `make typecheck` then checked no module and reported 0 errors."""
    import shutil

    (tmp_path / "pyrightconfig.json").write_text('{"include": ["elsewhere"]}')
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(ROOT / "pyproject.toml", checkout)
    shutil.copytree(ROOT / "protocol", checkout / "protocol", ignore=shutil.ignore_patterns("__pycache__"))
    command = subprocess.run(
        ["make", "-s", "-n", "typecheck", f"BIN={Path(sys.executable).parent}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]
    checked = subprocess.run(command + " --verbose", shell=True, cwd=checkout, capture_output=True, text=True)
    assert f"Loading pyproject.toml file at {checkout / 'pyproject.toml'}" in checked.stdout, checked.stdout[-2000:]
    assert "0 errors" in checked.stdout and "No source files found" not in checked.stdout
