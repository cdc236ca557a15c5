"""Named points where a test kills the run, as a user's Ctrl-\\ or the OOM killer would.

``VARIANTBENCH_KILL_AT=fidelity`` makes the process that reaches ``fault_point("fidelity")`` SIGKILL
its whole process group there: the run's parent and every variant's process die at once, with no
``finally`` run and no file closed. The crash tests (``tests/integration/test_resume.py``) start the
run in a session of its own and kill it at the first look, in fidelity and in the diagnosis, then
rebuild its report and resume it. Without the variable a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "VARIANTBENCH_KILL_AT"


def fault_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.killpg(os.getpgrp(), signal.SIGKILL)
