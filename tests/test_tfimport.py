"""TensorFlow's load-time log lines: hidden as TF_CPP_MIN_LOG_LEVEL asks, nothing else lost."""

import subprocess
import sys
import textwrap

import pytest

from tfkv.tfimport import shown

NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


@pytest.mark.parametrize("line,level,expected", [
    (NOTICE, 0, True), (NOTICE, 1, False),
    ("I0000 00:00:1795612888.598514 3909 port.cc:153] oneDNN custom operations are on.", 1, False),
    ("I0000 00:00:1795612888.598514 3909 port.cc:153] oneDNN custom operations are on.", 0, True),
    ("W0000 00:00:1.0 1 x.cc:1] a warning", 1, True), ("W0000 00:00:1.0 1 x.cc:1] a warning", 2, False),
    ("E0000 00:00:1.0 1 x.cc:1] an error", 2, True), ("E0000 00:00:1.0 1 x.cc:1] an error", 3, False),
    ("Traceback (most recent call last):", 3, True),
])
def test_what_each_level_hides(line, level, expected):
    assert shown(line, level) is expected


def _import(tmp_path, level, fake=None):
    if fake is not None:  # a stand-in package named tensorflow, to know exactly what it writes
        (tmp_path / "tensorflow").mkdir(exist_ok=True)
        (tmp_path / "tensorflow" / "__init__.py").write_text(fake)
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "{level}"
        {'sys.path.insert(0, ' + repr(str(tmp_path)) + ')' if fake is not None else ''}
        from tfkv.tfimport import import_tensorflow
        tf = import_tensorflow()
        print("imported", tf.__name__)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_lines_written_to_fd_2_while_importing_are_filtered_not_lost(tmp_path):
    """A stand-in `tensorflow` writes TF's two load-time lines and a line of its own straight to
    file descriptor 2, as TensorFlow's C++ does: level 2 keeps only its own line, level 0 all."""
    fake = (f"import os\nos.write(2, b'{NOTICE}\\n')\n"
            "os.write(2, b'I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\\n')\n"
            "os.write(2, b'something that matters\\n')\n")
    quiet = _import(tmp_path, 2, fake)
    assert quiet.returncode == 0 and quiet.stdout == "imported tensorflow\n"
    assert quiet.stderr == "something that matters\n"
    loud = _import(tmp_path, 0, fake)
    assert loud.stderr.splitlines() == [NOTICE, "I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.",
                                        "something that matters"]


def test_the_real_tensorflow_imports_without_a_line_on_stderr(tmp_path):
    got = _import(tmp_path, 2)
    assert got.returncode == 0 and got.stdout == "imported tensorflow\n"
    assert got.stderr == "", got.stderr
