"""The README's code runs as written."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run_and_print_what_they_say():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
        claimed = re.findall(r"print\(.*?\)\s+# (.+)", code)  # "print(x)   # what it prints"
        assert out.getvalue().splitlines() == [c.strip() for c in claimed]
