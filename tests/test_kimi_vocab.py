"""kimi_vocab is the ground floor: importing the effort levels loads neither torch nor our other packages."""
import subprocess
import sys


def test_the_effort_levels_import_without_torch():
    code = ("import sys, kimi_vocab.effort as e; assert e.effort_order('max') == 3; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'numpy', 'policy', 'envs', 'rl', 'sandbox', 'kimi_kernels'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
