"""FBGEMM's own TBE training tests, with TritonTBE as the module under test.

    git -C FBGEMM archive v1.6.0 fbgemm_gpu/test | tar -x -C /tmp/fb     # the tag of the installed fbgemm-gpu
    python tools/fbgemm_tests.py /tmp/fb/fbgemm_gpu/test --examples 8 [--json out.json] [-- pytest args]

FBGEMM's tests build `SplitTableBatchedEmbeddingBagsCodegen` and check it against their own references
(`nn.EmbeddingBag` sums, dense gradients, their optimizer formulas). This runs them with that name bound to
`torchrec_triton_tbe.TritonTBE` in every test module (`--fbgemm` leaves FBGEMM's class, the baseline), so
the module meets test cases we did not write. The tests are read from an FBGEMM checkout the user gives,
never copied into this project.

* A construction TritonTBE refuses (NotImplementedError: UVM or cache placements, an optimizer or weight
  decay mode it does not have) is rejected as a hypothesis example (`hypothesis.reject`), so the test draws
  another instead of stopping at the first; every refusal is counted by its message and printed at the
  end (and in `--json`). A test that draws no examples, or whose every example was refused, fails on its
  refusals and is counted "refused", not "failed" (the exit status is 0 when every failure is a refusal).
  `--no-reject` lets refusals fail tests.
* FBGEMM's GPU tests TorchScript the module (`torch.jit.script(cc)`); TritonTBE launches Triton kernels from
  Python and refuses TorchScript, so there `torch.jit.script` hands a TritonTBE back unscripted.
* Deselected by default (`--all` keeps them): the `_v1` tests, which drive FBGEMM's low-level lookup
  functions with the module's private storage (`prepare_inputs`, `weights_offsets`, ...), and the generated
  operator checks (faketensor, schema, autograd_registration, aot_dispatch, pt2_compliant) of FBGEMM's ops.
* `--examples N` sets the tests' MAX_EXAMPLES and MAX_EXAMPLES_LONG_RUNNING (FBGEMM's 40 and 15);
  examples are derandomized and not shrunk. Without a GPU, Triton's interpreter runs the kernels and
  `gradcheck` uses fast mode (one random projection: the full Jacobian needs a backward per output).
* Many drawn examples return before building a module (FBGEMM skips them on CPU or for their size): the
  summary counts the modules each test built, so a test that passed without building one is visible.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

DEFAULT_FILES = (
    "tbe/training/forward_test.py",
    "tbe/training/backward_sgd_test.py",
    "tbe/training/backward_adagrad_test.py",
    "tbe/training/backward_optimizers_test.py",
    "tbe/training/backward_none_test.py",
)
# Tests that reach into FBGEMM's private lookup path, and FBGEMM's generated checks of its own operators.
DESELECT = "not _v1 and not faketensor and not schema and not autograd_registration and not aot_dispatch " \
           "and not pt2_compliant"


class Substitute:
    """pytest plugin: binds the module under test in FBGEMM's test modules, counts what was built."""

    def __init__(self, examples: int, ours: bool, reject_refusals: bool, fast_gradcheck: bool):
        self.examples, self.ours, self.reject_refusals = examples, ours, reject_refusals
        self.fast_gradcheck = fast_gradcheck
        self.built: collections.Counter = collections.Counter()  # test id -> modules built
        self.refused: collections.Counter = collections.Counter()  # refusal message -> count
        self.outcomes: dict[str, str] = {}
        self.refusing: set = set()  # tests in which a construction was refused
        self._test = None

    def pytest_configure(self, config):
        from hypothesis import HealthCheck, Phase, settings

        import tbe.common as common  # FBGEMM's test settings; must be set before the test modules import them

        common.MAX_EXAMPLES = common.MAX_EXAMPLES_LONG_RUNNING = self.examples
        settings.register_profile(
            "fbgemm_tests", derandomize=True, database=None, deadline=None,
            phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking: examples are slow to rerun
            suppress_health_check=list(HealthCheck),
        )
        settings.load_profile("fbgemm_tests")

    def pytest_collection_modifyitems(self, session, config, items):
        import torch
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        from torchrec_triton_tbe import TritonTBE

        cls = TritonTBE if self.ours else SplitTableBatchedEmbeddingBagsCodegen

        def build(*args, **kwargs):
            try:
                module = cls(*args, **kwargs)
            except NotImplementedError as exc:
                self.refused[str(exc)] += 1
                self.refusing.add(self._test)
                if self.reject_refusals:
                    from hypothesis import reject

                    reject()
                raise
            self.built[self._test] += 1
            return module

        def fast(gradcheck):
            def fast_gradcheck(fn, inputs, *args, **kwargs):
                kwargs.setdefault("fast_mode", True)
                return gradcheck(fn, inputs, *args, **kwargs)

            return fast_gradcheck

        if self.ours:
            # FBGEMM's GPU tests TorchScript the module (torch.jit.script(cc)); ours cannot be scripted (it
            # launches Triton kernels from Python and refuses), so those tests use it unscripted.
            script = torch.jit.script

            def unscripted(obj, *args, **kwargs):
                return obj if isinstance(obj, TritonTBE) else script(obj, *args, **kwargs)

            torch.jit.script = unscripted
        for name, module in list(sys.modules.items()):
            if not name.startswith("tbe.") or module is None:
                continue
            if getattr(module, "SplitTableBatchedEmbeddingBagsCodegen", None) is SplitTableBatchedEmbeddingBagsCodegen:
                module.SplitTableBatchedEmbeddingBagsCodegen = build
            # Theirs (test_utils.gradcheck, which passes its keywords to torch's) or torch's own.
            if self.fast_gradcheck and callable(getattr(module, "gradcheck", None)):
                module.gradcheck = fast(module.gradcheck)

    def pytest_runtest_setup(self, item):
        self._test = item.nodeid

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)
            if report.outcome == "failed":
                # A test that fails on its refusals ("refused", not "failed"): one without hypothesis examples to
                # draw again, or one whose every example was refused.
                text = report.longreprtext
                # Unsatisfiable: hypothesis found every example rejected.
                refused = self.reject_refusals and report.nodeid in self.refusing and any(
                    mark in text
                    for mark in ("UnsatisfiedAssumption", "Unsatisfiable", "NotImplementedError: TritonTBE"))
                self.outcomes[report.nodeid] = "refused" if refused else "failed"

    def summary(self) -> dict:
        return {
            "module": "TritonTBE" if self.ours else "SplitTableBatchedEmbeddingBagsCodegen",
            "examples": self.examples,
            "tests": {test: {"outcome": outcome, "modules_built": self.built[test]}
                      for test, outcome in sorted(self.outcomes.items())},
            "refusals": dict(self.refused.most_common()),
        }


def pytest_arguments(given: list[str], test_dir: Path, keep_all: bool) -> list[str]:
    """pytest's arguments: the user's as given (options with their values, paths), the default files when
    none of them names a path in the test folder, and the deselection joined to the user's ``-k`` (pytest
    keeps only the last ``-k``)."""
    out, keyword, i = [], None, 0
    while i < len(given):
        arg = given[i]
        if arg == "-k" and i + 1 < len(given):
            keyword, i = given[i + 1], i + 2
            continue
        if arg.startswith("-k") and len(arg) > 2:
            keyword = arg[2:]
        else:
            out.append(arg)
        i += 1
    paths = [a for a in out if not a.startswith("-") and (test_dir / a.split("::")[0]).exists()]
    if not paths:
        out += list(DEFAULT_FILES)
    if not keep_all:
        keyword = DESELECT if keyword is None else f"({keyword}) and ({DESELECT})"
    return out + (["-k", keyword] if keyword is not None else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("test_dir", help="FBGEMM's fbgemm_gpu/test folder (from the tag of the installed fbgemm-gpu)")
    parser.add_argument("--examples", type=int, default=8, help="hypothesis examples per test (FBGEMM's: 40 / 15)")
    parser.add_argument("--fbgemm", action="store_true", help="baseline: FBGEMM's own module under test")
    parser.add_argument("--no-reject", action="store_true", help="a refused construction fails its test")
    parser.add_argument("--all", action="store_true", help="keep the _v1 tests and FBGEMM's operator checks")
    parser.add_argument("--json", help="write outcomes, modules built per test and refusals here")
    parser.epilog = "after --: pytest's arguments (test paths in the folder; default: " + ", ".join(DEFAULT_FILES) + ")"
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    test_dir = Path(args.test_dir).resolve()
    if not (test_dir / "tbe" / "common.py").is_file():
        parser.error(f"{test_dir} is not FBGEMM's fbgemm_gpu/test folder (no tbe/common.py in it)")

    import torchrec_triton_tbe  # noqa: F401  sets TRITON_INTERPRET=1 without CUDA, before anything defines kernels
    import pytest
    import torch

    plugin = Substitute(args.examples, not args.fbgemm, not args.no_reject, not torch.cuda.is_available())
    os.chdir(test_dir)
    sys.path.insert(0, str(test_dir))  # FBGEMM's open-source tests import `test_utils` and `tbe.*` from here
    rc = pytest.main(["-p", "no:cacheprovider", "-q", "-rfE", *pytest_arguments(pytest_args, test_dir, args.all)],
                     plugins=[plugin])
    summary = plugin.summary()
    counts = collections.Counter(t["outcome"] for t in summary["tests"].values())
    idle = [t for t, r in summary["tests"].items() if r["outcome"] == "passed" and not r["modules_built"]]
    print(f"\n{summary['module']}: {dict(counts)}; {sum(plugin.built.values())} modules built; "
          f"{len(idle)} passed tests built none")
    for message, count in summary["refusals"].items():
        print(f"  refused {count}x: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if rc == pytest.ExitCode.TESTS_FAILED and not counts["failed"]:
        return 0  # every failure was a refusal, listed above
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
