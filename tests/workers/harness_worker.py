"""Worker of the harness test: rank 1 floods its output and crashes, rank 0 hangs."""

import os
import sys
import time

if os.environ["RANK"] == "1":
    sys.stdout.write("x" * 1_000_000)  # more than a pipe holds: must not block the launcher
    sys.stdout.flush()
    raise ValueError("rank 1 crashed on purpose")
time.sleep(600)
