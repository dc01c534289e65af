"""docs/models.md is rendered from JUnit results of tests/test_architectures.py."""

from pathlib import Path

from sleuth.testing.model_matrix import collect, main

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_architectures" name="test_packing[llama]" time="1.0"/>
<testcase classname="tests.test_architectures" name="test_lora[gpt_oss]" time="1.0">
  <failure message="AssertionError: merged weights differ | by 0.3">long traceback</failure></testcase>
<testcase classname="tests.test_architectures" name="test_vllm_load[qwen3]" time="0.0">
  <skipped type="pytest.skip" message="vLLM is not installed"/></testcase>
<testcase classname="tests.test_architectures" name="long_groups_helper" time="0.0"/>
</testsuite></testsuites>
"""


def test_collect_and_render(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    junit.write_text(JUNIT)
    cells = collect(junit)
    assert cells == {
        "llama": {"packing": ("passed", "")},
        "gpt_oss": {"LoRA": ("failed", "AssertionError: merged weights differ | by 0.3")},
        "qwen3": {"vLLM load": ("skipped", "vLLM is not installed")},
    }
    out = tmp_path / "models.md"
    assert main(["--junit", str(junit), "--out", str(out), "--note", "vLLM not run here."]) == 0
    text = out.read_text()
    assert "vLLM not run here." in text
    assert "| llama | passed | not run |" in text
    assert "failed: AssertionError: merged weights differ / by 0.3" in text  # no stray table pipe
    assert "| qwen3 | not run | not run | not run | not run | skipped: vLLM is not installed |" in text


def test_no_results_is_an_error(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite name="pytest"></testsuite></testsuites>')
    assert main(["--junit", str(junit), "--out", str(tmp_path / "m.md")]) == 1
    assert not (tmp_path / "m.md").exists()
