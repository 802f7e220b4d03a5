"""Peak memory of one system's save and restore, measured in a fresh process.

    python -m benchmarks.memory SYSTEM_NAME COUNT NBYTES DIRECTORY

prints {"save": bytes, "restore": bytes}: the peak resident memory beyond what the process
held with the model loaded (Linux: VmHWM after resetting it through /proc/self/clear_refs).
"""

from __future__ import annotations

import json
import os
import sys

from .run import make_model
from .systems import all_systems


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def measure(name: str, count: int, nbytes: int, directory: str) -> dict[str, int]:
    system = next(s for s in all_systems() if s.name == name)
    model, variables = make_model(count, nbytes)
    system.prepare(model, variables)
    path = os.path.join(directory, f"memory.{system.ext}")
    out = {}
    for what, action in (("save", lambda: system.save(path, model)),
                         ("restore", lambda: system.restore(path, model))):
        base = _status("VmRSS")
        _reset_peak()
        result = action()
        out[what] = _status("VmHWM") - base
        del result
    os.remove(path)
    return out


if __name__ == "__main__":
    name, count, nbytes, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(measure(name, count, nbytes, directory)))
