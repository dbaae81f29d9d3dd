"""A method is declared once on each side: its wire types in protocol/methods.py, and how the
worker runs it with its handler in worker/policy.py, checked by pyright against those types."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import protocol.methods
import worker.policy
from protocol.methods import METHODS
from worker.generation import AUTO
from worker.policy import DECLARATIONS, POLICY

ROOT = Path(__file__).resolve().parent.parent


def test_every_protocol_method_has_exactly_one_worker_declaration_in_the_protocols_order():
    assert [declared.spec for declared in DECLARATIONS] == list(METHODS.values())
    assert list(POLICY) == list(METHODS)


def test_pyright_refuses_a_declaration_whose_handler_does_not_take_its_params_or_give_its_result(tmp_path: Path):
    rows = [
        "Method(spec=TOKENIZE, handler=Handlers.tokenize, lane=Lane.TEXT)",
        "Method(spec=TOKENIZE, handler=Handlers.detokenize, lane=Lane.TEXT)",  # other params
        "Method(spec=SHUTDOWN, handler=Handlers.unload, lane=Lane.MODEL)",  # a result where null is the answer
        "BatchedMethod(spec=PREFILL, prompt=Handlers.prompt, task=Handlers.generate, lane=Lane.MODEL)",  # other task
    ]
    module = tmp_path / "declared.py"
    module.write_text(
        "from protocol.methods import PREFILL, SHUTDOWN, TOKENIZE\n"
        "from worker.handlers import Handlers\n"
        "from worker.policy import BatchedMethod, Lane, Method\n" + "".join(f"{row}\n" for row in rows)
    )
    checked = subprocess.run(
        [Path(sys.executable).parent / "pyright", "--project", "pyproject.toml", "--pythonpath", sys.executable,
         "--outputjson", str(module)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"},
    )
    report = json.loads(checked.stdout)
    assert report["summary"]["filesAnalyzed"] == 1, report
    refused = {d["range"]["start"]["line"] - 3 for d in report["generalDiagnostics"] if d["severity"] == "error"}
    assert refused == {1, 2, 3}, report["generalDiagnostics"]


def test_the_modules_that_apply_the_rules_name_no_method_and_no_auto():
    """What a method is allowed and waits for is its declaration's, not a test of its name."""
    for name in ("session", "locked_session", "admission", "responder", "text_lane", "model_lane", "scheduler"):
        tree = ast.parse((ROOT / "worker" / f"{name}.py").read_text())
        named = [
            node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and (node.value in METHODS or node.value == AUTO)
        ]
        assert named == [], f"worker/{name}.py names {named}"


def test_the_architecture_s_row_for_adding_a_method_names_what_the_code_declares():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("\n")
    row = next(line for line in lines if line.startswith("| add a method |"))
    assert "protocol/methods.py" in row and "worker/policy.py" in row and "worker/dispatcher.py" not in row
    assert f"`_method({', '.join(inspect.signature(protocol.methods._method).parameters)})`" in row
    for name in ("DECLARATIONS", "Method", "BatchedMethod", "Handlers"):
        assert f"`{name}`" in row and hasattr(worker.policy, name), name
