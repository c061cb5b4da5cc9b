"""`make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`, and the modules
that share an expensive fixture (a real model loaded, a snakemake run) name an `xdist_group` so
it is built on one worker only (tests/conftest.py). A pytest or xdist release that silently stops
grouping (pytest 9.2 with xdist 3.8 did: pytest-dev/pytest-xdist#1386) would build each such
fixture once per worker and slow the suite down without failing it: this fails instead."""

import re
import subprocess
import sys
import textwrap


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    body = textwrap.dedent("""
        import pytest
        pytestmark = pytest.mark.xdist_group("shared")

        @pytest.mark.parametrize("i", range(4))
        def test_grouped(i):
            pass
    """)
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(body)
    (tmp_path / "test_free.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_free(i):\n    pass\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", "-o", "addopts=", "-o", "pythonpath=", "--rootdir", str(tmp_path), str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ran = re.findall(r"\[(gw\d)\].*PASSED \S*(test_one|test_two|test_free)\.py", p.stdout)
    assert len(ran) == 14, p.stdout
    grouped = {gw for gw, mod in ran if mod != "test_free"}
    assert len(grouped) == 1, f"the 'shared' group ran on {sorted(grouped)}:\n{p.stdout}"
    assert {gw for gw, _ in ran} == {"gw0", "gw1"}, p.stdout  # the other tests still spread over both
