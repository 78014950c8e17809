"""README's Usage code is the core of examples/train_custom.py, verbatim, and its launch line
takes a free port instead of a fixed one."""

import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "# --- Usage: begin (README.md shows this block verbatim) ---\n"
END = "# --- Usage: end ---"


def usage_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Usage\n")
    return readme[start : readme.index("\n## ", start + 1)]


def test_readme_usage_code_is_the_example_core_verbatim():
    source = (ROOT / "examples" / "train_custom.py").read_text()
    assert source.count(BEGIN) == 1 and source.count(END) == 1
    core = textwrap.dedent(source.split(BEGIN, 1)[1].split(END, 1)[0]).strip("\n ")
    imports, block = usage_blocks()
    assert block == core, "README.md's Usage code differs from examples/train_custom.py: copy it over"
    assert "prepare_mindspore" in imports and "args = parse_args()" in imports


def usage_blocks() -> tuple[str, str]:
    """The Usage section's two Python blocks: the imports, then the script's core."""
    blocks = [b.split("\n```", 1)[0] for b in usage_section().split("```python\n")[1:]]
    assert len(blocks) == 2, f"Usage shows {len(blocks)} Python blocks, expected imports + core"
    return blocks[0], blocks[1]


def test_readme_launch_line_picks_a_free_port():
    section = usage_section()
    msrun = [line for line in section.splitlines() if line.lstrip().startswith(("msrun", "GLOG_v=3 msrun"))]
    assert msrun, "no msrun launch line in Usage"
    assert all("--master_port=$PORT" in line for line in msrun)
    assert "s.bind(('127.0.0.1', 0))" in section  # the port comes from the operating system
    assert "graph_exec.examples.train_custom" in section
