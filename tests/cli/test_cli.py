"""The `kvm-maglev` command line itself: --version."""

import importlib.metadata
import subprocess
import sys

import pytest

from kvm_maglev import cli


def test_version_prints_the_installed_version(capsys):
    expected = f"kvm-maglev {importlib.metadata.version('kvm_maglev')}"
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == expected
    result = subprocess.run([sys.executable, "-m", "kvm_maglev", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == expected


def test_version_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--version" in capsys.readouterr().out
