"""What the instruction benchmarks (benches/load/instructions.py, benches/redis/instructions.py)
read from callgrind: the instructions counted in a process's last dump."""

import re
import subprocess
from pathlib import Path


def total(work, prefix):
    """The program's total instructions in the newest dump `prefix`.* in `work` (the one
    `callgrind_control -d` wrote)."""
    dumps = sorted(Path(work).glob(f"{prefix}.*"), key=lambda p: p.stat().st_mtime)
    text = subprocess.run(["callgrind_annotate", str(dumps[-1])], capture_output=True, text=True,
                          check=True).stdout
    return int(re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", text).group(1).replace(",", ""))
