"""Start a real `bulkhead serve` on free ports for the Python tests and tools.

The binary is $BULKHEAD_BIN, else target/debug/bulkhead (what `cargo test` builds).
"""

import contextlib
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model's own name (its file's)
ALIAS = "smollm2"  # a second name, as --model-id given twice serves it

# The servers are on loopback: no proxy from the environment may stand in between, for this
# process (urllib, the openai client) or the tools it starts (schemathesis).
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"


class Server:
    """A running `bulkhead serve`: its HTTP address and the path of its log."""

    def __init__(self, addr, log):
        self.addr = addr
        self.log = log

    def log_tail(self, lines=60):
        """The last `lines` lines of the server's log."""
        text = Path(self.log).read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)


def ready(addr):
    """Whether `GET /ready` answers 200 (the workers registered)."""
    try:
        with urllib.request.urlopen(f"http://{addr}/ready", timeout=5) as r:
            return r.status == 200
    except OSError:  # refused, or 503 (HTTPError is an OSError)
        return False


@contextlib.contextmanager
def serve(*args, ready_timeout=60, wait_ready=True):
    """`bulkhead serve --port 0` (gateway, one prefill and one decode worker) with `args`,
    serving the default model under its own name and ALIAS; killed with its workers on exit.
    `wait_ready=False` for a gateway without workers (`--role gateway`), never ready."""
    binary = os.environ.get("BULKHEAD_BIN", str(ROOT / "target" / "debug" / "bulkhead"))
    fd, log = tempfile.mkstemp(prefix="bulkhead-serve-", suffix=".log")
    env = {**os.environ, "BULKHEAD_LOG": os.environ.get("BULKHEAD_LOG", "info")}
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen(
            [binary, "serve", "--port", "0", "--threads", "1", "--model-id", MODEL, "--model-id", ALIAS, *args],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=env,
        )
    try:
        # "bulkhead: serving on http://ADDR (workers register at ADDR)"
        line = proc.stdout.readline()
        if "http://" not in line:
            proc.wait(timeout=30)
            raise RuntimeError(f"bulkhead serve did not start ({binary}): {line!r}\n{Path(log).read_text()}")
        server = Server(line.split("http://", 1)[1].split()[0], log)
        deadline = time.monotonic() + ready_timeout
        while wait_ready and not ready(server.addr):
            if time.monotonic() > deadline:
                raise RuntimeError(f"bulkhead serve never became ready:\n{server.log_tail()}")
            time.sleep(0.1)
        yield server
    finally:
        # SIGKILL on the parent closes the workers' gateway connections: they exit too.
        proc.kill()
        proc.wait()
        os.unlink(log)
