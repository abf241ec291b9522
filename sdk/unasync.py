"""Generate the sync client (``runstate/_sync/``) from the async one (``runstate/_async/``).

The async modules are the source of truth; each listed one is rewritten token by token
(``async def`` -> ``def``, ``await x`` -> ``x``, ``AsyncFoo`` -> ``Foo``, ``aclose`` ->
``close``, ``asyncio.sleep`` -> ``time.sleep``...) and formatted with ruff. The worker
loops (``consume.py``) and claim holders (``hold.py``) differ in kind and are written by
hand on both sides.

    python sdk/unasync.py           # rewrite runstate/_sync/
    python sdk/unasync.py --check   # exit 1 if runstate/_sync/ is stale
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "runstate" / "_async"
TARGET = ROOT / "runstate" / "_sync"
MODULES = [
    "http.py",
    "work.py",
    "groups.py",
    "clock.py",
    "runs.py",
    "client.py",
    "admissions.py",
    "quotas.py",
    "budgets.py",
]

# Applied in order. Word boundaries keep names like ``asyncio`` intact.
SUBSTITUTIONS: list[tuple[str, str]] = [
    (r"runstate\._async\.", "runstate._sync."),
    (r"^import asyncio$", "import time"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\b([Tt])he async client\b", r"\1he sync client"),
    (r"\ban async context manager\b", "a context manager"),
    (r"\bAsync([A-Z]\w*)", r"\1"),
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    (r"\baclose\b", "close"),
    (r"\baiter_lines\b", "iter_lines"),
    (r"\baread\b", "read"),
]


def unasync(text: str, name: str) -> str:
    """Return the sync rewrite of one async module's text."""
    for pattern, replacement in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    header = f"# Generated from runstate/_async/{name} by sdk/unasync.py: edit that file, then regenerate.\n"
    return header + text


def ruff(args: list[str], text: str, path: Path) -> str:
    """Pipe ``text`` through ``ruff <args>`` as if it were ``path``."""
    command = [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(path), "-"]
    done = subprocess.run(command, input=text, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode not in (0, 1) or not done.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed on {path}:\n{done.stderr}")
    return done.stdout


def generate() -> dict[Path, str]:
    """Return the text of every generated module, keyed by its path."""
    generated = {}
    for name in MODULES:
        path = TARGET / name
        text = unasync((SOURCE / name).read_text(), name)
        text = ruff(["check", "--fix", "--select", "I", "--quiet", "--exit-zero"], text, path)
        generated[path] = ruff(["format", "--quiet"], text, path)
    return generated


def main(argv: list[str]) -> int:
    """Write the sync modules, or with ``--check`` report the stale ones."""
    check = "--check" in argv
    stale = []
    for path, text in generate().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
