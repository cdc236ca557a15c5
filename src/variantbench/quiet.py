"""Keep library chatter off the user's console.

torchao's missing-CUDA-kernel notices and torch's pytree deprecation lines are logged at WARNING
on every import and say nothing about the run.
"""

from __future__ import annotations

import logging


def quiet_libraries() -> None:
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
