"""The suite's copies of the reference document's snippets are the document's, verbatim.

The suite runs from a checkout with nothing beside it, so it keeps the snippets it runs:
the Python ones in ``tests/sdk/seed_snippets.py`` (``test_seed.py``) and the TypeScript ones
in ``sdk/typescript/test/seed-blocks.md`` (``seed.test.ts``). Where the document is there
(``../shared/seeds`` beside the checkout, as in CI, or ``RUNSTATE_SEED_DIR``), each copy must
match it block for block, in order; the parser is checked on its own either way.
"""

import os
import re
from pathlib import Path

import pytest

from tests.sdk import seed_snippets

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]
SEED_DIR = Path(os.environ.get("RUNSTATE_SEED_DIR") or ROOT.parent / "shared" / "seeds")
DOCUMENT = SEED_DIR / "000_b3519fa2e86ad14e.txt"
TS_COPY = ROOT / "sdk" / "typescript" / "test" / "seed-blocks.md"

_HEADING = re.compile(r"^#{2,4} (.*)$")
_FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(text: str, languages: tuple[str, ...]) -> list[tuple[str, str]]:
    """Return ``(heading, source)`` for every fenced block in one of ``languages``, in order."""
    found, heading, lines, index = [], "", text.split("\n"), 0
    while index < len(lines):
        if match := _HEADING.match(lines[index]):
            heading = match.group(1)
        elif (match := _FENCE.match(lines[index])) and match.group(1):
            body = []
            index += 1
            while index < len(lines) and not _FENCE.match(lines[index]):
                body.append(lines[index])
                index += 1
            if match.group(1) in languages:
                found.append((heading, "\n".join(body)))
        index += 1
    return found


def test_the_block_reader_keeps_headings_order_and_languages():
    text = "## A\n\n```ts\nconst a = 1;\n```\n\n### B\n```python\nb = 2\n```\n```typescript\nlet c;\n\n```\n"
    assert blocks(text, ("ts", "typescript")) == [("A", "const a = 1;"), ("B", "let c;\n")]
    assert blocks(text, ("python",)) == [("B", "b = 2")]


def test_the_typescript_copy_holds_the_five_blocks_seed_test_runs():
    headings = [heading for heading, _ in blocks(TS_COPY.read_text(), ("ts", "typescript"))]
    assert headings == [
        "Create a group and submit members",
        "Record verdicts and wait for the decision",
        "Cancel a run",
        "Barriers",
        "Timers",
    ]


@pytest.mark.skipif(not DOCUMENT.exists(), reason=f"the reference document is not beside the checkout ({DOCUMENT})")
def test_the_copies_are_the_documents_blocks_verbatim():
    document = DOCUMENT.read_text()
    typescript = ("ts", "typescript")
    assert blocks(TS_COPY.read_text(), typescript) == blocks(document, typescript)
    python = [source + "\n" for _, source in blocks(document, ("python", "py"))]
    copied = [value for name, value in vars(seed_snippets).items() if name.isupper() and isinstance(value, str)]
    assert copied == python
