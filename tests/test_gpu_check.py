"""tools/gpu_check.py, the one command a lent GPU runs, kept working between GPU windows: its
--smoke mode runs every section's code at tiny sizes on the CPU and must pass, section by section
(a section FSDP cannot run on this torch's CPU says 'skipped' with the reason), and a failing
section must not stop the ones after it nor lose the ones before it."""

import os
import subprocess
import sys

import pytest

import parallelism
import prepare_c4
from tools import gpu_correctness, gpu_measurements

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIKTOKEN = os.environ.get("TIKTOKEN_CACHE_DIR")


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """Section 8's dataset as the GPU run gets it (prepare_c4.py --from_text), where GPT-2's BPE is available offline."""
    if not (TIKTOKEN and os.path.isdir(TIKTOKEN)):
        return None
    root = tmp_path_factory.mktemp("bpe")
    text = root / "input.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: to be, or not to be.\nThat is line two of {i}." for i in range(300)))
    prepare_c4.prepare(shards=1, out_dir=str(root / "c4"), workers=1, from_text=str(text))
    return str(root / "c4")


def run_check(tmp_path, *args):
    out = tmp_path / "gpu.md"
    result = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--out", str(out), *args], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result, out.read_text() if out.exists() else ""


def sections_of(report):
    """{number: text} of each '## N. title' section of the report."""
    parts = report.split("\n## ")[1:]
    return {int(part.split(".", 1)[0]): part for part in parts}


def test_smoke_runs_every_section_on_the_cpu(tmp_path, bpe_data):
    args = ["--data_dir", bpe_data] if bpe_data else ["--sections", "1,2,3,4,5,6,7"]
    result, report = run_check(tmp_path, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = sections_of(report)
    assert sorted(sections) == ([1, 2, 3, 4, 5, 6, 7, 8] if bpe_data else [1, 2, 3, 4, 5, 6, 7])
    assert "FAILED" not in report
    assert report.startswith("# The GPU check") and "- torch " in report and "- command: " in report
    fsdp = parallelism.fsdp_unavailable("cpu")
    for number in (5, 7):
        assert ("skipped: " + fsdp in sections[number]) if fsdp else "skipped" not in sections[number]
    # figures, not just headings: every loss checked, every kind of block compiled as one graph
    models = len(gpu_correctness.MODELS)  # checked forward and backward, then compiled
    assert sections[2].count("| ok |") == len(gpu_correctness.loss_cases(2, 16, 8, 32)) + 2 * models
    assert "| llama MoE | 1 | 0 | 0 |" in sections[2] and "| llama MoE dropless | 1 | 0 | 0 |" in sections[2]
    # the MoE's two routings side by side, neither dropping a slot
    assert "| share of routed slots dropped | 0.0000 | 0 | 0.0000 | 0 |" in sections[6]
    assert "ms per step" in sections[3] and "MFU" in sections[3]
    for name in gpu_measurements.LOSS_COSTS:
        assert f"| {name} |" in sections[4]
    if not fsdp:
        # the CPU's kernels are deterministic: the round trip, the resumed run and a second run all exact
        assert sections[7].count("| 0.0e+00 (bit-identical) |") == 3, sections[7]
    if bpe_data:
        assert "sample.py" in sections[8] and "validation loss at step 0" in sections[8]


def test_a_failing_section_is_one_line_and_the_next_one_runs(tmp_path):
    """Section 4 needs section 3's model: alone it fails in one line, section 1 before it is kept,
    section 8 after it still runs (and fails in one line without its data), and the exit status says so."""
    result, report = run_check(tmp_path, "--sections", "1,4,8")
    assert result.returncode == 1
    sections = sections_of(report)
    assert sorted(sections) == [1, 4, 8]
    assert "TFLOP/s" in sections[1] and "FAILED" not in sections[1]
    assert "**FAILED**: RuntimeError: needs section 3's model" in sections[4]
    assert "**FAILED**: RuntimeError: needs --data_dir" in sections[8]
    assert "sections failed: 4, 8" in report


def test_bad_sections_are_one_line(tmp_path):
    result, _ = run_check(tmp_path, "--sections", "9")
    assert result.returncode == 2 and "--sections must be numbers from 1 to 8" in result.stderr
