"""docs/service.md shows the example loop's own code: the block under its marker is, line for
line, the ``BestOfNLoop`` class of examples/best_of_n.py up to its ``progress_line`` (the page
cannot drift from the loop a test runs)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_service_page_shows_the_example_loops_code():
    page = (ROOT / "docs" / "service.md").read_text()
    block = re.search(r"<!-- service-example:[^>]*-->\n```python\n(.*?)```", page, re.S).group(1)
    example = (ROOT / "examples" / "best_of_n.py").read_text()
    start = example.index("class BestOfNLoop(Loop):")
    end = example.index("    def progress_line(", start)
    assert block.strip() == example[start:end].strip()
