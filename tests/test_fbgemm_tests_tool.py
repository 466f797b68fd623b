"""tools/fbgemm_tests.py, which runs FBGEMM's own TBE tests with TritonTBE as the module under test: here on a
stand-in test folder laid out as FBGEMM's (``tbe/common.py`` with its example counts, a test module that
imports FBGEMM's class by name), since FBGEMM's tests are not part of this project. The stand-in test
asserts what it built, so a substitution that did not happen fails it."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TEST_MODULE = '''
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from hypothesis import given, settings, strategies as st

from ..common import MAX_EXAMPLES

EXPECT = __import__("os").environ["EXPECT_MODULE"]


def build(optimizer):
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optimizer, learning_rate=0.1)


@settings(max_examples=MAX_EXAMPLES)
@given(st.integers(0, 3))
def test_drawn(i):
    # Every other example asks for an optimizer TritonTBE refuses: rejected, so the test draws others.
    optimizer = OptimType.ROWWISE_RMSPROP_AR if i % 2 and EXPECT == "TritonTBE" else OptimType.EXACT_SGD
    module = build(optimizer)
    assert type(module).__name__ == EXPECT
    if EXPECT == "TritonTBE":
        assert torch.jit.script(module) is module  # FBGEMM's GPU tests script the module: ours runs unscripted
    out = module(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    assert out.shape == (2, 4)


@settings(max_examples=MAX_EXAMPLES)
@given(st.integers(0, 3))
def test_every_example_refused(i):
    build(OptimType.ROWWISE_RMSPROP_AR if EXPECT == "TritonTBE" else OptimType.EXACT_SGD)


def test_without_examples():
    build(OptimType.ROWWISE_RMSPROP_AR if EXPECT == "TritonTBE" else OptimType.EXACT_SGD)


def test_skipped():
    import pytest

    pytest.skip("nothing built")
'''


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "tbe" / "training").mkdir(parents=True)
    (tmp_path / "tbe" / "__init__.py").write_text("")
    (tmp_path / "tbe" / "training" / "__init__.py").write_text("")
    (tmp_path / "tbe" / "common.py").write_text("MAX_EXAMPLES = 40\nMAX_EXAMPLES_LONG_RUNNING = 15\n")
    (tmp_path / "tbe" / "training" / "standin_test.py").write_text(textwrap.dedent(TEST_MODULE))
    return tmp_path


def _run(folder, *args, expect: str, pytest_args=("tbe/training/standin_test.py",)):
    out = folder / "out.json"
    env = {**os.environ, "EXPECT_MODULE": expect, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fbgemm_tests.py"), str(folder), "--examples", "6",
                           "--json", str(out), *args, "--", *pytest_args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_runs_the_tests_on_triton_tbe_and_counts_refusals(folder):
    proc, summary = _run(folder, expect="TritonTBE")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tests = summary["tests"]
    drawn = tests["tbe/training/standin_test.py::test_drawn"]
    assert drawn["outcome"] == "passed" and 1 <= drawn["modules_built"] <= 6, drawn
    assert tests["tbe/training/standin_test.py::test_without_examples"] == {"outcome": "refused", "modules_built": 0}
    assert tests["tbe/training/standin_test.py::test_every_example_refused"] == {"outcome": "refused",
                                                                                "modules_built": 0}
    assert tests["tbe/training/standin_test.py::test_skipped"]["outcome"] == "skipped"
    (message, count), = summary["refusals"].items()
    assert "ROWWISE_RMSPROP_AR is not supported" in message and count >= 2
    assert summary["module"] == "TritonTBE" and summary["examples"] == 6
    assert "refused" in proc.stdout and "1 passed tests built none" not in proc.stdout


def test_no_reject_fails_the_test_and_the_run(folder):
    proc, summary = _run(folder, "--no-reject", expect="TritonTBE")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert summary["tests"]["tbe/training/standin_test.py::test_drawn"]["outcome"] == "failed"


def test_fbgemm_baseline_builds_fbgemms_module(folder):
    proc, summary = _run(folder, "--fbgemm", expect="SplitTableBatchedEmbeddingBagsCodegen")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {t["outcome"] for t in summary["tests"].values()} == {"passed", "skipped"}
    assert summary["refusals"] == {}


def test_refuses_a_folder_that_is_not_fbgemms(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fbgemm_tests.py"), str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "no tbe/common.py" in proc.stderr


def test_pytest_arguments_keep_the_users_and_join_the_deselection():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fbgemm_tests", ROOT / "tools" / "fbgemm_tests.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    folder = ROOT / "tests"  # any folder: paths are looked up in it
    assert tool.pytest_arguments([], folder, keep_all=False) == [*tool.DEFAULT_FILES, "-k", tool.DESELECT]
    assert tool.pytest_arguments(["-k", "sgd", "-x"], folder, keep_all=False) == [
        "-x", *tool.DEFAULT_FILES, "-k", f"(sgd) and ({tool.DESELECT})"]
    assert tool.pytest_arguments(["-ksgd"], folder, keep_all=True) == [*tool.DEFAULT_FILES, "-k", "sgd"]
    # A path in the folder (a file, a test id or a directory) replaces the defaults; option values stay put.
    given = ["--deselect", "conftest.py::x", "gpu", "test_vbe.py::test_a"]
    assert tool.pytest_arguments(given, folder, keep_all=True) == given


def test_a_users_keyword_selects_within_the_tool(folder):
    proc, summary = _run(folder, expect="TritonTBE", pytest_args=("-k", "skipped", "tbe/training/standin_test.py"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert list(summary["tests"]) == ["tbe/training/standin_test.py::test_skipped"]
