"""Chaos soak against a running `bulkhead serve` (scripts/soak.sh starts one and runs this).

Clients send chat requests with and without `max_tokens`, prompts of roughly 20 to 4,000
tokens, some streamed, some of them hanging up early, spread over the gateways given; on a
schedule a random worker or gateway process is killed with SIGKILL, and a keyless
attacker trickles handshake bytes into a decode worker's KV port from as many
connections as it can hold. At the end it prints requests by outcome, every request whose
outcome is not a success, a clean 429, a clean error while a prefill worker it may have
used died (a decode worker's death must cost nothing: its requests move), a cut
connection of a gateway that was killed (the other gateway's clients must see nothing), a
`timeout` once the server's request limit has passed, or a deliberate hang-up; pages free
on every worker; RSS of every process at start and end; and isolation-check failures.
Exit status 1 if any of those is wrong.

Standard library only.
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import sys
import threading
import time
from collections import Counter

# Growth of a worker's RSS that is never counted as a leak (see the RSS check).
RSS_SLACK_KIB = 80 * 1024
# How long after the soak's end requests still in flight may run before they are cut.
GRACE_S = 20.0

WORDS = ("the a river stone light city night over under quickly bright green old new "
         "story music window garden letter number silver morning engine bridge").split()


def prompt_of(rng, tokens):
    # About one token per short word for this tokenizer.
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def children(pid):
    """Worker processes of `serve` (its direct children), as {pid: role}."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid or " Z " in stat.rsplit(")", 1)[1][:3]:
                continue
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            # `serve --role all` names each child in its argv[0]: bulkhead-prefill,
            # bulkhead-decode, bulkhead-gateway-N (its settings come on standard input).
            name = os.path.basename(args[0]).decode(errors="replace")
            if name.startswith("bulkhead-"):
                out[int(p)] = name[len("bulkhead-"):]
            elif b"--role" in args:
                role = args[args.index(b"--role") + 1].decode()
                if role == "gateway" and b"--gateway-id" in args:
                    role = "gateway-" + args[args.index(b"--gateway-id") + 1].decode()
                out[int(p)] = role
        except (OSError, ValueError, IndexError):
            continue
    return out


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def metrics(host, port):
    """Samples of /metrics, and of the operator's page (the cache activity) with
    $BULKHEAD_ADMIN_KEY, which scripts/soak.sh gives serve."""
    body = ""
    key = os.environ.get("BULKHEAD_ADMIN_KEY")
    for path, headers in [("/metrics", {}), ("/metrics/tenants", {"Authorization": f"Bearer {key}"} if key else None)]:
        if headers is None:
            continue
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        if r.status == 200:
            body += text
    samples = []
    for line in body.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        samples.append((m.group(1), labels, float(m.group(4))))
    return samples


def excused_loss(err):
    """Whether a lost worker excuses this error. A lost prefill worker may cost a request
    its answer (it is retried once); a lost decode worker may not: its requests move to
    another decode worker, unless one moved `--migration-limit` times already or had sent
    its last token but not its end."""
    msg = str(err.get("message", ""))
    if "decode" in msg:
        return "migration limit" in msg or "last token was sent" in msg
    return True


def lost_role(err):
    """Which worker an error says was lost: "a decode worker", "a prefill worker" or "a worker"."""
    msg = str(err.get("message", ""))
    for role in ("decode", "prefill"):
        if role in msg:
            return f"a {role} worker"
    return "a worker"


def kv_addresses(log):
    """The KV ports the decode workers announced so far (restarts announce new ones)."""
    try:
        with open(log) as f:
            return re.findall(r'decode worker registered.*kv_addr="([^"]+)"', f.read())
    except OSError:
        return []


class Trickle:
    """A keyless peer that holds as many connections to a decode worker's KV port as it can,
    each sending a byte of an unfinished handshake every two seconds (the doors must cut
    them and keep room for the real prefill workers)."""

    def __init__(self, log, conns):
        self.log, self.conns = log, conns
        self.opened = self.cut = 0
        self.stop = threading.Event()

    def run(self):
        socks = []
        while not self.stop.is_set():
            addrs = kv_addresses(self.log)
            if addrs:
                host, port = addrs[-1].rsplit(":", 1)
                while len(socks) < self.conns:
                    try:
                        socks.append(socket.create_connection((host, int(port)), timeout=1))
                        self.opened += 1
                    except OSError:
                        break
            alive = []
            for s in socks:
                try:
                    s.send(b"B")
                    alive.append(s)
                except OSError:
                    self.cut += 1
                    s.close()
            socks = alive
            self.stop.wait(2.0)
        for s in socks:
            s.close()


class Soak:
    def __init__(self, a):
        self.a = a
        self.gateways = [(h, int(p)) for h, p in (x.rsplit(":", 1) for x in a.addr.split(","))]
        self.host, self.port = self.gateways[0]
        self.lock = threading.Lock()
        self.outcomes = Counter()
        self.bad = []
        self.kills = []  # (time, pid, role)
        self.missed = []  # (at, role): planned kills that found no such process
        self.stop_at = time.monotonic() + a.duration
        self.done = threading.Event()
        c = http.client.HTTPConnection(self.host, self.port, timeout=30)
        c.request("GET", "/v1/models")
        self.model = json.loads(c.getresponse().read())["data"][0]["id"]  # the served model's name
        c.close()

    def killed_during(self, start, end, roles=("prefill", "decode")):
        """Whether a process of one of `roles` was killed while a request ran."""
        with self.lock:
            return any(start <= t <= end + 1.0 and r in roles for t, _, r in self.kills)

    def gateway_down(self, g, start, end):
        """Whether gateway `g` was killed while a request ran, or is still coming back."""
        role = f"gateway-{g}"
        with self.lock:
            return any(r == role and t <= end + 1.0 and (t >= start or end - t < 30.0) for t, _, r in self.kills)

    def at_server_limit(self, start, err):
        """A `timeout` error once the request has run for the server's --request-timeout-ms:
        the documented limit (a generation without max_tokens can outlast it here)."""
        return err.get("code") == "timeout" and time.monotonic() - start >= self.a.server_request_timeout - 1.0

    def record(self, outcome, detail=None):
        with self.lock:
            self.outcomes[outcome] += 1
            if detail is not None:
                self.bad.append((outcome, detail))

    def one(self, rng, g):
        host, port = self.gateways[g]
        tokens = rng.randint(20, self.a.max_prompt)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt_of(rng, tokens)}]}
        if rng.random() < 0.5:
            body["max_tokens"] = rng.randint(1, 256)
        stream = rng.random() < 0.6
        hang_up = rng.random() < 0.2
        if stream:
            body["stream"] = True
        start = time.monotonic()
        # Requests still running when the soak ends are cut then (clients without
        # max_tokens may generate thousands of tokens).
        limit = max(1.0, min(self.a.request_timeout, self.stop_at + GRACE_S - start))
        c = http.client.HTTPConnection(host, port, timeout=limit)
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            if hang_up and not stream:
                # Leave before the answer: the server must abort the request.
                time.sleep(rng.uniform(0.05, 2.0))
                c.close()
                return self.record("hung up (deliberate)")
            r = c.getresponse()
            if r.status == 429:
                err = json.loads(r.read() or b"{}")
                ok = "error" in err and r.getheader("Retry-After") is not None
                return self.record("429", None if ok else f"429 without error body or Retry-After: {err}")
            if r.status != 200:
                raw = r.read()
                try:
                    err = json.loads(raw)["error"]
                except (ValueError, KeyError, TypeError):
                    return self.record(f"{r.status} garbled", f"{r.status} with a body that is no OpenAI error: {raw[:200]!r}")
                if self.killed_during(start, time.monotonic()) and err.get("code") in ("worker_lost", "overloaded") and excused_loss(err):
                    return self.record(f"{r.status} {err.get('code')} after {lost_role(err)} died")
                if self.at_server_limit(start, err):
                    return self.record(f"{r.status} timeout at the server's request limit")
                if r.status == 503 and self.gateway_down(g, start, time.monotonic()):
                    # Restarted, it answers before the workers have registered again (its
                    # /ready says so).
                    time.sleep(0.5)
                    return self.record("503 while its gateway restarts (deliberate)")
                return self.record(f"{r.status} {err.get('code')}", f"{r.status}: {err.get('message')}")
            if not stream:
                v = json.loads(r.read())
                fin = v["choices"][0]["finish_reason"]
                return self.record("200 " + fin, None if fin in ("stop", "length") else f"finish_reason {fin}")
            chunks = 0
            finished = error = done = False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                v = json.loads(data)
                if "error" in v:
                    error = v["error"]
                    continue
                chunks += 1
                if time.monotonic() >= self.stop_at + GRACE_S:
                    return self.record("cut at the end of the soak (deliberate)")
                if v["choices"] and v["choices"][0].get("finish_reason"):
                    finished = True
                if hang_up and chunks >= 3:
                    c.close()
                    return self.record("hung up mid-stream (deliberate)")
            if finished and done and not error:
                return self.record("200 streamed")
            if not done and self.gateway_down(g, start, time.monotonic()):
                return self.record("stream cut: its gateway was killed (deliberate)")
            if error and done and self.killed_during(start, time.monotonic()) and error.get("code") == "worker_lost" and excused_loss(error):
                return self.record(f"stream error after {lost_role(error)} died")
            if error and done and self.at_server_limit(start, error):
                return self.record("stream ended at the server's request limit")
            return self.record("stream anomaly", f"finished={finished} error={error} [DONE]={done} after {chunks} chunks")
        except TimeoutError as e:
            if time.monotonic() >= self.stop_at + GRACE_S - 1:
                return self.record("cut at the end of the soak (deliberate)")
            return self.record("client timeout", f"{type(e).__name__}: {e}")
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
            if isinstance(e, (ConnectionError, http.client.HTTPException)) and self.gateway_down(g, start, time.monotonic()):
                # Its clients reconnect once serve has restarted it.
                time.sleep(0.5)
                return self.record("connection cut or refused: its gateway was killed (deliberate)")
            if self.killed_during(start, time.monotonic()) and isinstance(e, (ConnectionError, http.client.HTTPException)):
                return self.record("connection cut after a worker died", f"{type(e).__name__}: {e}")
            return self.record("client error", f"{type(e).__name__}: {e}")
        finally:
            c.close()

    def client(self, seed, g):
        rng = random.Random(seed)
        while time.monotonic() < self.stop_at:
            self.one(rng, g)

    def killer(self, serve_pid, rng):
        for at, role in self.a.kills:
            while time.monotonic() < self.t0 + at:
                if self.done.wait(0.2):
                    return
            workers = [p for p, r in children(serve_pid).items() if role in (r, "any") or (role == "gateway" and r.startswith("gateway-"))]
            if not workers:
                print(f"soak: no {role} worker to kill at {at} s", flush=True)
                with self.lock:
                    self.missed.append((at, role))
                continue
            pid = rng.choice(workers)
            role_of = children(serve_pid).get(pid, "?")
            os.kill(pid, signal.SIGKILL)
            with self.lock:
                self.kills.append((time.monotonic(), pid, role_of))
            print(f"soak: {at:>4} s: kill -9 {role_of} {pid}", flush=True)


def wait_for_workers(host, port, n):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if len({l["worker"] for name, l, _ in metrics(host, port) if name == "bulkhead:kv_pool_pages" and "worker" in l}) >= n:
                return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"soak: fewer than {n} workers registered")


def parse_kills(spec, duration, every):
    if spec:
        return [(float(t), r) for t, r in (k.split(":") for k in spec.split(","))]
    return [(t, "any") for t in range(every, int(duration), every)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True, help="HOST:PORT of each gateway, comma-separated")
    ap.add_argument("--log", help="serve's log, to find a decode worker's KV port for the trickle attacker")
    ap.add_argument("--trickle", type=int, default=256, help="attacker connections to hold (0: none)")
    ap.add_argument("--serve-pid", type=int, required=True)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=4000)
    ap.add_argument("--kill-every", type=int, default=120)
    ap.add_argument("--kills", default="", help="explicit schedule, e.g. 20:prefill,40:decode")
    ap.add_argument("--request-timeout", type=float, default=660)
    ap.add_argument("--server-request-timeout", type=float, default=600, help="serve's --request-timeout-ms, in s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4, help="workers to wait for before starting")
    a = ap.parse_args()
    a.kills = parse_kills(a.kills, a.duration, a.kill_every)
    s = Soak(a)
    wait_for_workers(s.host, s.port, a.workers)
    s.t0 = time.monotonic()
    rng = random.Random(a.seed)
    killer = threading.Thread(target=s.killer, args=(a.serve_pid, random.Random(a.seed + 1)), daemon=True)
    killer.start()
    trickle = Trickle(a.log, a.trickle) if a.log and a.trickle else None
    if trickle:
        threading.Thread(target=trickle.run, daemon=True).start()
    threads = [threading.Thread(target=s.client, args=(rng.random(), i % len(s.gateways))) for i in range(a.clients)]
    for t in threads:
        t.start()
    # RSS after a warm-up (pools and buffers touched), before the first kill.
    time.sleep(min(30.0, a.duration / 6, max(0.0, min(t for t, _ in a.kills) - 1) if a.kills else 30.0))
    rss_start = {a.serve_pid: ("gateway", rss_kib(a.serve_pid))}
    rss_start.update({p: (r, rss_kib(p)) for p, r in children(a.serve_pid).items()})
    for t in threads:
        t.join()
    s.done.set()
    killer.join()
    if trickle:
        trickle.stop.set()
    failed = False

    print(f"\nsoak: {sum(s.outcomes.values())} requests in {time.monotonic() - s.t0:.0f} s, "
          f"{a.clients} clients on {len(s.gateways)} gateway(s), {len(s.kills)} processes killed")
    if trickle:
        print(f"trickle attacker: {trickle.opened} keyless connections opened, {trickle.cut} cut by the KV port's door")
    for k, n in sorted(s.outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {n:>6}  {k}")
    print(f"requests with an unclean outcome: {len(s.bad)}")
    for outcome, detail in s.bad[:40]:
        print(f"  {outcome}: {detail}")
    failed |= bool(s.bad)
    # A soak that killed nothing it was asked to kill tested nothing it was meant to.
    for at, role in s.missed:
        print(f"soak: the kill of a {role} worker planned at {at} s found none")
    failed |= bool(s.missed)

    # Let aborted and failed requests settle, then every worker's pool must be whole again.
    deadline = time.monotonic() + 60
    while True:
        m = metrics(s.host, s.port)
        pools = {}
        for name, labels, v in m:
            if name in ("bulkhead:kv_free_pages", "bulkhead:kv_cached_pages", "bulkhead:kv_pool_pages",
                        "bulkhead:quarantined_pages", "bulkhead:kv_shared_leases") and "worker" in labels:
                pools.setdefault(labels["worker"], {})[name.split(":")[1]] = v
        # Whole: every page free, or held by the prefix cache with no reader.
        busy = {w: p for w, p in pools.items()
                if p.get("kv_free_pages", 0) + p.get("kv_cached_pages", 0) != p.get("kv_pool_pages")
                or p.get("quarantined_pages", 0) or p.get("kv_shared_leases", 0)}
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(1)
    print("pages at the end (free + cached by the prefix cache / pool):")
    for w, p in sorted(pools.items()):
        print(f"  {w:<12} {p.get('kv_free_pages', 0):>8.0f} + {p.get('kv_cached_pages', 0):.0f} / {p.get('kv_pool_pages', 0):.0f}")
    if busy:
        print(f"  NOT WHOLE: {sorted(busy)}")
        failed = True

    print("RSS (KiB) at start and end:")
    live = {a.serve_pid: "gateway"}
    live.update(children(a.serve_pid))
    for pid, (role, before) in sorted(rss_start.items()):
        after = rss_kib(pid) if pid in live else None
        note = "killed" if after is None else f"{(after - before) / before * 100:+.1f}%"
        print(f"  {role:<8} pid {pid:<8} {before or 0:>10} -> {after if after is not None else '-':>10}  {note}")
    for pid, role in sorted(live.items()):
        if pid not in rss_start:
            print(f"  {role:<8} pid {pid:<8} {'(restarted)':>10} -> {rss_kib(pid):>10}")
    # A leak shows as growth past 10% or RSS_SLACK_KIB, whichever is more: a worker that took
    # a killed one's streams grows its step buffers and allocator arenas by about 45-60 MB
    # (measured at both 0.58 and 0.51 GB baselines), which is no leak; the long soak is
    # where a leak shows.
    grew = [(role, pid) for pid, (role, before) in rss_start.items()
            if pid in live and before and (rss_kib(pid) or 0) > before + max(before // 10, RSS_SLACK_KIB)]
    if grew:
        print(f"  RSS grew more than 10% (and {RSS_SLACK_KIB // 1024} MiB): {grew}")
        failed = True

    checks = Counter()
    for name, labels, v in m:
        if name == "bulkhead:isolation_failures_total":
            checks[labels.get("check", "?")] += v
    # Lease, canary and audit failures are reads that would have crossed requests; chunk and
    # coverage failures are transfers refused (cut by a kill), which is the checks working.
    leaks = sum(checks[c] for c in ("lease", "canary", "audit"))
    print(f"isolation-check failures: {leaks:.0f} (lease {checks['lease']:.0f}, canary {checks['canary']:.0f}, "
          f"audit {checks['audit']:.0f}); transfers refused: chunk {checks['chunk_verified']:.0f}, "
          f"coverage {checks['coverage']:.0f} (killed workers' counters are gone with them)")
    failed |= leaks > 0
    print("soak: FAILED" if failed else "soak: passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
