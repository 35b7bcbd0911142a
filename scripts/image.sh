#!/usr/bin/env bash
# Build Bulkhead's container image offline with Debian's podman: FROM scratch with the
# binary, the shared libraries it (and UCX, which it dlopens) needs, and a minimal root.
# Nothing is pulled from any registry. See deploy/container/Containerfile and
# deploy/kubernetes/README.md.
#
#   bash scripts/image.sh                  # tag localhost/bulkhead:dev
#   IMAGE=localhost/bulkhead:1 bash scripts/image.sh
#
# Environment:
#   BULKHEAD_BIN  the binary to package (default: target/release/bulkhead under
#                 $CARGO_TARGET_DIR or the repository; built with cargo when absent)
#   IMAGE         the tag (default localhost/bulkhead:dev)
# Needs root or a working rootless podman; installs podman with apt-get when root and it
# is missing. UCX is packaged when Debian's libucx0 is installed (apt-get install libucx0
# when root); without it the image runs, with TCP as the KV transport.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
image=${IMAGE:-localhost/bulkhead:dev}
arch_lib=/usr/lib/x86_64-linux-gnu

if ! command -v podman >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "image.sh: installing podman (apt-get)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman >/dev/null
    else
        echo "image.sh: podman is not installed (apt-get install podman)" >&2
        exit 1
    fi
fi
if [ ! -e "$arch_lib/libucp.so.0" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "image.sh: installing UCX (apt-get install libucx0)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx0 >/dev/null || true
fi

bin=${BULKHEAD_BIN:-${CARGO_TARGET_DIR:-$repo/target}/release/bulkhead}
if [ ! -x "$bin" ]; then
    echo "image.sh: building $bin (cargo build --release -p bulkhead)" >&2
    (cd "$repo" && cargo build --release -p bulkhead)
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root"/{usr/bin,usr/lib,usr/lib64,usr/sbin,usr/local/bin,etc,tmp,var/lib/bulkhead,models,run/bulkhead}
ln -s usr/bin "$root/bin"
ln -s usr/lib "$root/lib"
ln -s usr/lib64 "$root/lib64"
ln -s usr/sbin "$root/sbin"
chmod 1777 "$root/tmp"
chmod 700 "$root/run/bulkhead"
install -m 0755 "$bin" "$root/usr/local/bin/bulkhead"

# Copy a file by its real path under /usr (merged /usr), with the symlink chain that names it.
put() {
    local f=$1
    while :; do
        local real
        real=$(readlink -f "$f")
        local canon=${f#/}
        case $canon in lib/* | lib64/* | bin/* | sbin/*) canon=usr/$canon ;; esac
        if [ -L "$f" ]; then
            mkdir -p "$root/$(dirname "$canon")"
            [ -e "$root/$canon" ] || [ -L "$root/$canon" ] || cp -P "$f" "$root/$canon"
            local next
            next=$(readlink "$f")
            case $next in /*) f=$next ;; *) f=$(dirname "$f")/$next ;; esac
        else
            mkdir -p "$root/$(dirname "$canon")"
            [ -e "$root/$canon" ] || cp "$real" "$root/$canon"
            return
        fi
    done
}
# Every library a file links, transitively (ldd resolves the whole tree).
deps() { ldd "$1" 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $3} /^\t\/.*ld-linux/ {print $1}'; }

files=("$bin")
if [ -e "$arch_lib/libucp.so.0" ]; then
    files+=("$arch_lib/libucp.so.0")
    for m in "$arch_lib"/ucx/*.so.0 "$arch_lib"/libibverbs/*.so; do [ -e "$m" ] && files+=("$m"); done
    ucx=yes
else
    ucx="no (libucx0 is not installed: the image's workers use TCP for KV)"
fi
for f in "${files[@]}"; do
    [ "$f" = "$bin" ] || put "$f"
    for d in $(deps "$f"); do put "$d"; done
done
if [ -d /etc/libibverbs.d ]; then cp -r /etc/libibverbs.d "$root/etc/"; fi

cat >"$root/etc/passwd" <<'P'
root:x:0:0:root:/var/lib/bulkhead:/nonexistent
nobody:x:65534:65534:nobody:/nonexistent:/nonexistent
P
cat >"$root/etc/group" <<'G'
root:x:0:
nogroup:x:65534:
G
echo 'hosts: files dns' >"$root/etc/nsswitch.conf"

cp "$repo/deploy/container/Containerfile" "$ctx/Containerfile"
echo "image.sh: root file system: $(du -sh "$root" | cut -f1), UCX: $ucx" >&2
podman build --quiet --no-cache -f "$ctx/Containerfile" -t "$image" "$ctx" >/dev/null
echo "image.sh: built $image ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
