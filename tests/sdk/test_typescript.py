"""The TypeScript SDK (``sdk/typescript``, ``@runstate/client``) against the live service.

The package is installed with ``npm ci`` from its committed lockfile (skipped while
``node_modules`` matches it), built and type-checked with ``tsc`` (``strict`` with
``noUncheckedIndexedAccess``), then its ``node --test`` suite runs against the same uvicorn
server the Python SDK tests use, with ``RUNSTATE_URL`` / ``RUNSTATE_API_KEY`` in its
environment and a key bound to a run for the subtree test; the reference document's
TypeScript blocks run from their verbatim copy in the package (``test/seed-blocks.md``).
Node >= 20 is required: without it these tests fail with a message saying so (never skip).

``single_backend`` (``scripts/test`` runs them in its PostgreSQL run only): the type check
touches no database, and the node suite drives the SDK over HTTP, whose server paths the
rest of the suite runs on both databases (tests/api, tests/concurrency).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess

import pytest

from coordination.services.keys import ALL_PERMISSIONS
from runstate import Runstate
from tests.sdk.conftest import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.single_backend]

PACKAGE = ROOT / "sdk" / "typescript"
NODE_MAJOR = 20
LOCK_STAMP = PACKAGE / "node_modules" / ".runstate-lock-sha256"


def run(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` in the package, output captured (stderr folded into stdout)."""
    return subprocess.run(
        command,
        cwd=PACKAGE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def require_node() -> str:
    """Return the path of ``node`` (>= 20) or fail saying what is missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail(f"The TypeScript SDK needs Node.js >= {NODE_MAJOR} with npm on PATH; none found.", pytrace=False)
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    match = re.match(r"v(\d+)\.", version)
    if match is None or int(match.group(1)) < NODE_MAJOR:
        found = version or "of an unknown version"
        pytest.fail(f"The TypeScript SDK needs Node.js >= {NODE_MAJOR}; {node} is {found}.", pytrace=False)
    return node


@pytest.fixture(scope="module")
def built_package():
    """Install the package's dev dependencies (``npm ci``, once per lockfile) and build it with ``tsc``."""
    node = require_node()
    lock = hashlib.sha256((PACKAGE / "package-lock.json").read_bytes()).hexdigest()
    if not LOCK_STAMP.exists() or LOCK_STAMP.read_text() != lock:
        installed = run(["npm", "ci", "--no-audit", "--no-fund"], timeout=600)
        assert installed.returncode == 0, f"npm ci failed:\n{installed.stdout}"
        LOCK_STAMP.write_text(lock)
    shutil.rmtree(PACKAGE / "dist", ignore_errors=True)
    built = run([node, "node_modules/typescript/bin/tsc", "-p", "tsconfig.json"], timeout=600)
    assert built.returncode == 0, f"tsc (strict, noUncheckedIndexedAccess) failed:\n{built.stdout}"
    return node


def test_the_package_type_checks_strictly_and_has_no_runtime_dependencies(built_package):
    config = (PACKAGE / "tsconfig.json").read_text()
    assert '"strict": true' in config and '"noUncheckedIndexedAccess": true' in config
    package = (PACKAGE / "package.json").read_text()
    # No runtime dependency: the tools and tracing test kit are devDependencies, and
    # @opentelemetry/api (tracing, issue 29) is an optional peer, loaded only when installed.
    manifest = json.loads(package)
    assert "dependencies" not in manifest
    assert manifest["peerDependenciesMeta"] == {"@opentelemetry/api": {"optional": True}}
    assert set(manifest["peerDependencies"]) == {"@opentelemetry/api"}
    assert (PACKAGE / "dist" / "src" / "index.d.ts").exists()
    checked = run([built_package, "node_modules/typescript/bin/tsc", "-p", "tsconfig.json", "--noEmit"], timeout=600)
    assert checked.returncode == 0, checked.stdout


@pytest.mark.timeout(900)
def test_the_node_test_suite_passes_against_the_live_server(sdk, make_key, built_package):
    with Runstate() as rs:
        bound_run = rs.scopes.create(name="bound key's run")
    env = dict(
        os.environ,
        RUNSTATE_URL=sdk.url,
        RUNSTATE_API_KEY=sdk.api_key,
        RUNSTATE_TEST_BOUND_RUN_ID=bound_run.id,
        RUNSTATE_TEST_BOUND_API_KEY=make_key(ALL_PERMISSIONS, run_id=bound_run.id),
    )
    env.pop("RUNSTATE_SCOPE_ID", None)
    files = sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "dist" / "test").glob("*.test.js"))
    assert files, "no compiled test files under sdk/typescript/dist/test"
    pattern = os.environ.get("RUNSTATE_TS_TEST_PATTERN")  # narrow the suite while developing
    command = [built_package, "--test", "--test-concurrency=2", "--test-reporter=spec"]
    if pattern:
        command.append(f"--test-name-pattern={pattern}")
    result = run([*command, *files], timeout=840, env=env)
    print(result.stdout)  # shown by pytest -rP, or -s
    assert result.returncode == 0, f"node --test failed:\n{result.stdout[-20000:]}"
    assert re.search(r"^ℹ fail 0$", result.stdout, re.MULTILINE), result.stdout[-5000:]
