import signal
import subprocess
import sys

import pytest

from pdserve.engine.process_exit import describe_exit, killed_by


@pytest.mark.parametrize("code,text", [(0, "code 0"), (1, "code 1"), (-9, "code -9, killed by SIGKILL"),
                                       (-15, "code -15, killed by SIGTERM"), (-99, "code -99, killed by signal 99")])
def test_an_exit_reads_as_its_code_and_its_signal(code, text):
    assert describe_exit(code) == text


def test_only_a_negative_code_is_a_signal():
    assert killed_by(0) is None and killed_by(3) is None
    assert killed_by(-int(signal.SIGKILL)) == "SIGKILL"


def test_a_real_killed_process_reads_as_killed_by_sigkill():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    assert describe_exit(proc.wait()) == f"code {-int(signal.SIGKILL)}, killed by SIGKILL"


def test_the_cli_reads_it_without_torch():
    code = "import sys, pdserve.cli.supervisor\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)
