"""The recipes run as scripts and learn."""

import re

import pytest
from conftest import REPO, python


@pytest.mark.parametrize("script,args", [
    ("train_digits.py", ["--devices", "4", "--kvstore", "device", "--epochs", "6"]),
    ("kvstore_by_hand.py", ["--devices", "2", "--epochs", "6"]),
])
def test_recipe_learns(tmp_path, script, args):
    proc = python(REPO / "recipes" / script, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    accs = [float(a) for a in re.findall(r"Test_acc (\d\.\d+)", proc.stdout)]
    assert len(accs) == 6 and accs[-1] >= 0.9, proc.stdout
