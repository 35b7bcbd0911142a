#!/usr/bin/env bash
# Run deploy/kubernetes/*.yaml with `podman kube play` on this one machine: a gateway, one
# prefill and one decode pod from the image scripts/image.sh builds; wait for /ready; check
# the workers' health listeners; a chat request answered through the gateway's port; the
# isolation counters read from /metrics; then everything torn down (pods, the model volume,
# the image unless KEEP_IMAGE=1). About a minute. Not part of scripts/test.sh (it needs root
# and podman); docs/OPERATIONS.md, "Kubernetes".
#
#   sudo bash scripts/kube-play.sh
#
# Environment:
#   MODEL_FILE    the GGUF to put in the model volume (default: the default model in
#                 ~/.cache/bulkhead/models; skipped with a reason when absent)
#   IMAGE         the image tag (default localhost/bulkhead:kube-play), built by image.sh
#   BULKHEAD_BIN  the binary image.sh packages (see scripts/image.sh)
#   PORT_BASE     host ports, all five in PORT_BASE..PORT_BASE+4 (so a confined range
#                 holds them): gateway HTTP PORT_BASE, prefill and decode health +1 and +2,
#                 gateway worker port +3, decode KV port +4 (default 18080)
#   KEEP_IMAGE=1  keep the image afterwards
#
# What differs from a real cluster, all done on a copy of the YAML (the files are not
# changed), each for a reason printed below:
#   - hostNetwork: podman gives pods neither cluster DNS nor Services, so the workers reach
#     the gateway at 127.0.0.1 and the decode pod advertises 127.0.0.1; ports move to
#     PORT_BASE... so that nothing else on this machine is disturbed; containerPorts go
#     (podman refuses port mappings with hostNetwork).
#   - the Secret volume becomes a host directory holding the key (mode 0600): podman 4.3
#     mounts a Secret volume as an empty named volume (and panics on one without
#     `optional`), so it cannot carry the key.
#   - the PersistentVolumeClaim becomes a podman named volume the script fills (podman's
#     own mapping of claims); the Services and the placeholder Secret are left out.
#   - no probes: podman runs httpGet probes as `curl` inside the container (the image has
#     none) from systemd timers (none here); the script queries the same endpoints itself.
#   - Debian's podman here: its default OCI runtime fails on this machine class (crun:
#     "cgroups in hybrid mode not supported"; runc: setrlimit not permitted), so the script
#     points podman at its own containers.conf (CONTAINERS_CONF) choosing runc, the
#     cgroupfs manager, no default ulimits and a file events log. Nothing under /etc changes.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
skip() {
    echo "kube-play.sh: SKIP: $*"
    exit 0
}
say() { echo "kube-play.sh: $*" >&2; }

[ "$(id -u)" = 0 ] || skip "needs root (podman with runc and the cgroupfs manager, as this machine class allows)"
need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v curl >/dev/null || need+=(curl)
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
if [ ${#need[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || skip "missing ${need[*]} and no apt-get to install them"
    say "installing ${need[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null || skip "apt-get install ${need[*]} failed"
fi
model=${MODEL_FILE:-${BULKHEAD_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/bulkhead}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$model" ] || skip "no model file at $model (set MODEL_FILE, or run bulkhead once with --model smollm2-135m to fetch it)"

image=${IMAGE:-localhost/bulkhead:kube-play}
base=${PORT_BASE:-18080}
[[ $base =~ ^[0-9]+$ ]] && [ "$base" -ge 1 ] && [ "$base" -le 65531 ] || { say "PORT_BASE must be a port number up to 65531, not '$base'"; exit 2; }
# Every port within PORT_BASE..PORT_BASE+4 (tests/python/test_kubernetes_yaml.py keeps them
# within 100 of the base, for a host that opens only a small range).
http=$base health_prefill=$((base + 1)) health_decode=$((base + 2)) workers=$((base + 3)) kv=$((base + 4))
for p in $http $health_prefill $health_decode $workers $kv; do
    if ss -Htln "sport = :$p" | grep -q .; then skip "port $p is in use (set PORT_BASE)"; fi
done

work=$(mktemp -d /tmp/bulkhead-kube-play.XXXXXX)
# podman builds its pods' infra image on first use; removed afterwards if this run made it.
had_pause=$(podman images -q localhost/podman-pause 2>/dev/null || true)
volume=bulkhead-models-kube-play-$$
cat >"$work/containers.conf" <<'EOF'
[containers]
# The default ulimits make runc call setrlimit, which this machine class does not permit.
default_ulimits = []
[engine]
# crun refuses this machine's hybrid cgroups; runc with cgroupfs (no systemd here) works.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF=$work/containers.conf

played=
cleanup() {
    local rc=$?
    set +e
    if [ -n "$played" ]; then
        if [ $rc != 0 ]; then
            for c in gateway prefill decode; do
                say "last log lines of the $c pod:"
                podman logs --tail 15 "bulkhead-$c-pod-0-$c" 2>&1 | sed 's/^/    /' >&2
            done
        fi
        podman kube down "$work/play.yaml" >/dev/null 2>&1
        for c in gateway prefill decode; do podman pod rm -f "bulkhead-$c-pod-0" >/dev/null 2>&1; done
    fi
    podman volume rm -f "$volume" >/dev/null 2>&1
    [ "${KEEP_IMAGE:-0}" = 1 ] || podman image rm -f "$image" >/dev/null 2>&1
    [ -n "$had_pause" ] || podman images -q localhost/podman-pause | xargs -r podman image rm -f >/dev/null 2>&1
    rm -rf "$work"
    say "torn down (pods, volume $volume$([ "${KEEP_IMAGE:-0}" = 1 ] || echo ", image $image"), $work)"
    exit $rc
}
trap cleanup EXIT

IMAGE=$image bash "$repo/scripts/image.sh" >&2

# The cluster key, made by the image itself, in a directory bound where the Secret would be.
mkdir -m 700 "$work/key"
podman run --rm --network none -v "$work/key:/out" "$image" keygen /out/cluster.key >/dev/null
say "cluster key: $(stat -c '%a %U' "$work/key/cluster.key") (what the Secret's defaultMode 0600 gives in a cluster)"

# The model volume, filled the way an operator would fill the claim.
podman volume create --label app.kubernetes.io/name=bulkhead "$volume" >/dev/null
cp "$model" "$(podman volume inspect --format '{{.Mountpoint}}' "$volume")/"
say "model volume $volume holds $(basename "$model") ($(du -h "$model" | cut -f1))"

python3 - "$repo/deploy/kubernetes" "$work/play.yaml" <<EOF
import glob, os, sys, yaml
src, out = sys.argv[1], sys.argv[2]
image, volume, key_dir, model = "$image", "$volume", "$work/key", os.path.basename("$model")
gateway = "127.0.0.1:$workers"
# Flags each role's YAML must carry, and their one-machine values.
flags = {
    "gateway": {"--port": "$http", "--worker-listen": "0.0.0.0:$workers", "--model": "/models/" + model},
    "prefill": {"--gateway": gateway, "--health-listen": "0.0.0.0:$health_prefill", "--model": "/models/" + model},
    "decode": {"--gateway": gateway, "--health-listen": "0.0.0.0:$health_decode", "--model": "/models/" + model,
               "--kv-listen": "0.0.0.0:$kv", "--kv-advertise": "127.0.0.1:$kv"},
}
docs = []
for f in sorted(glob.glob(os.path.join(src, "*.yaml"))):
    for d in yaml.safe_load_all(open(f)):
        if d and d["kind"] == "Deployment":
            docs.append(d)
assert sorted(d["metadata"]["name"] for d in docs) == ["bulkhead-decode", "bulkhead-gateway", "bulkhead-prefill"], docs
for d in docs:
    role = d["metadata"]["name"].removeprefix("bulkhead-")
    pod = d["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    for v in pod["volumes"]:
        if "secret" in v:
            v.pop("secret")
            v["hostPath"] = {"path": key_dir, "type": "Directory"}
        elif "persistentVolumeClaim" in v:
            v["persistentVolumeClaim"]["claimName"] = volume
    (c,) = pod["containers"]
    c["image"] = image
    c.pop("livenessProbe")
    c.pop("readinessProbe")
    c.pop("ports")  # podman refuses port mappings with hostNetwork
    c["env"] = [e for e in c.get("env", []) if e["name"] != "POD_IP"]
    args, want = [], dict(flags[role])
    for a in c["args"]:
        name = a.split("=", 1)[0]
        if name in want:
            a = name + "=" + want.pop(name)
        args.append(a)
    assert not want, f"{role}: the YAML lost {sorted(want)}"
    c["args"] = args
yaml.safe_dump_all(docs, open(out, "w"), sort_keys=False)
EOF
say "playing deploy/kubernetes (gateway, prefill, decode Deployments) with podman kube play"
played=1
podman kube play "$work/play.yaml" >/dev/null

say "waiting for the gateway's /ready (a prefill and a decode worker registered)"
for _ in $(seq 1 240); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/ready")" = 200 ] && break
    sleep 0.5
done
echo "GET /health -> $(curl -s "http://127.0.0.1:$http/health")"
echo "GET /ready  -> $(curl -sf "http://127.0.0.1:$http/ready")"
for w in prefill:$health_prefill decode:$health_decode; do
    echo "${w%%:*} worker GET /health -> $(curl -sf "http://127.0.0.1:${w##*:}/health"), GET /ready -> $(curl -sf "http://127.0.0.1:${w##*:}/ready")"
done

body='{"model":"'"$(basename "${model%.gguf}")"'","messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}],"max_tokens":16,"temperature":0}'
answer=$(curl -s -w '\n%{http_code}' -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$http/v1/chat/completions")
code=${answer##*$'\n'} answer=${answer%$'\n'*}
[ "$code" = 200 ] || { say "POST /v1/chat/completions: HTTP $code: $answer"; exit 1; }
python3 -c '
import json, sys
r = json.loads(sys.argv[1])
text = r["choices"][0]["message"]["content"]
print("chat answer through the gateway:", repr(text), "usage:", r["usage"])
assert text.strip(), "empty answer"
' "$answer"

rss=()
for c in gateway prefill decode; do
    pid=$(podman inspect --format '{{.State.Pid}}' "bulkhead-$c-pod-0-$c")
    rss+=("$c $(awk '/^VmRSS/ {printf "%d MiB", $2 / 1024}' "/proc/$pid/status")")
done
echo "resident memory after the request (against the YAML's requests): $(IFS=,; echo "${rss[*]}" | sed 's/,/, /g')"

metrics=$(curl -sf "http://127.0.0.1:$http/metrics")
echo "isolation counters from /metrics:"
grep -E '^bulkhead:(isolation_checks_total|isolation_failures_total|workers|kv_connections_total|auth_refusals_total)' <<<"$metrics" | sed 's/^/    /'
python3 -c '
import re, sys
ran = failed = 0
for line in sys.argv[1].splitlines():
    m = re.match(r"bulkhead:isolation_(checks|failures)_total\{(.*)\} (\S+)$", line)
    if m and m.group(1) == "checks": ran += float(m.group(3))
    if m and m.group(1) == "failures": failed += float(m.group(3))
verified = [l for l in sys.argv[1].splitlines() if l.startswith("bulkhead:isolation_checks_total{") and "check=\"chunk_verified\"" in l]
assert ran > 0 and verified and float(verified[0].split()[-1]) > 0, "no isolation checks counted"
assert failed == 0, f"{failed} isolation failures"
print(f"isolation checks ran: {ran:.0f}, failed: {failed:.0f}")
' "$metrics"
echo "kube-play.sh: OK"
