"""Start `bulkhead serve` and run schemathesis against its live /openapi.json.

Called by scripts/schemathesis.sh with the arguments to pass on to `schemathesis run`.
Schemathesis runs in a scratch directory (it leaves a `.schemathesis/` cache behind), so
paths among those arguments must be absolute.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bulkhead_server import serve

HERE = Path(__file__).resolve().parent

# A small context keeps prefills cheap and over-context refusals within the fuzzer's reach;
# schemathesis_hooks.py bounds the tokens generated.
CONTEXT = "256"


def main():
    with serve("--context-length", CONTEXT) as srv:
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
            "BULKHEAD_SCHEMATHESIS_CONTEXT": CONTEXT,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        }
        cmd = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"http://{srv.addr}/openapi.json",
            *sys.argv[1:],
        ]
        with tempfile.TemporaryDirectory(prefix="bulkhead-schemathesis-") as scratch:
            rc = subprocess.run(cmd, env=env, cwd=scratch).returncode
        if rc != 0:
            print(f"\n--- bulkhead serve log (last lines) ---\n{srv.log_tail()}", file=sys.stderr)
        return rc


if __name__ == "__main__":
    sys.exit(main())
