"""``pip install ./sdk`` ships every package of ``runstate``: ``sdk/pyproject.toml`` lists each one."""

import tomllib

import pytest

from tests.sdk.conftest import ROOT

pytestmark = pytest.mark.single_backend


def test_the_sdk_distribution_lists_every_package_of_runstate():
    config = tomllib.loads((ROOT / "sdk" / "pyproject.toml").read_text())["tool"]["setuptools"]
    source = ROOT / "runstate"
    packages = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in source.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert set(config["packages"]) == packages
    assert config["package-dir"] == {name: "../" + name.replace(".", "/") for name in packages}
