"""``shared-svc run`` with cProfile switched by signals, for ``bench_memory.py --profile``.

SIGUSR1 starts profiling the main thread (the event loop); SIGUSR2 stops it and writes the
stats to the file named by ``BENCH_PROFILE_OUT``. Not part of the product.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
from types import FrameType

from shared_svc.cli import main

_profile = cProfile.Profile()


def _start(_sig: int, _frame: FrameType | None) -> None:
    _profile.enable()


def _stop(_sig: int, _frame: FrameType | None) -> None:
    _profile.disable()
    _profile.dump_stats(os.environ["BENCH_PROFILE_OUT"])


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.exit(main(["run"]))
