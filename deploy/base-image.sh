#!/usr/bin/env bash
# The cpu image's base, made from the Debian mirror (no container registry is needed):
# a bookworm root filesystem with Python 3.11 (the cp311 wheels), venv, the Python headers,
# g++ and libgomp (the default CPU attention backend compiles its C++ kernels on first use)
# and the CA certificates, imported into podman. No apt lists or caches, docs or man pages.
#
#   deploy/base-image.sh [IMAGE] [MIRROR]
#
# IMAGE: default localhost/pdserve-base:bookworm; nothing is done when it exists already.
# MIRROR: default the bookworm mirror this machine's apt uses (/etc/apt/sources.list and
# sources.list.d, one-line or deb822 format), else http://deb.debian.org/debian.
# PODMAN may carry podman's global options (deploy/image.mk sets it).
set -euo pipefail
IMAGE=${1:-localhost/pdserve-base:bookworm}
PODMAN=${PODMAN:-podman}

# The first `deb` source of bookworm itself (not -security, -updates or -backports).
apt_mirror() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        # one-line: deb [options] URI SUITE COMPONENTS...
        awk '!/^[ \t]*#/ { sub(/\[[^]]*\]/, "") } $1 == "deb" && $3 == "bookworm" { print $2; exit }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        # deb822: stanzas separated by blank lines; Types: deb, Suites: ... bookworm ..., URIs: first one
        awk 'BEGIN { RS = ""; FS = "\n" }
             { deb = 0; suite = 0; uri = ""
               for (j = 1; j <= NF; j++) {
                 if ($j ~ /^Types:/ && $j ~ /[ \t]deb([ \t]|$)/) deb = 1
                 if ($j ~ /^Suites:/ && $j ~ /[ \t]bookworm([ \t]|$)/) suite = 1
                 if ($j ~ /^URIs:/) { split($j, w, /[ \t]+/); uri = w[2] } }
               if (deb && suite && uri != "") { print uri; exit } }' "$f"
    done
}
MIRROR=${2:-$(apt_mirror | head -n 1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if $PODMAN image exists "$IMAGE"; then
    echo "base image $IMAGE exists"
    exit 0
fi
command -v mmdebstrap >/dev/null || { echo "base-image.sh: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "base image $IMAGE: bookworm from $MIRROR"
mmdebstrap --variant=apt --quiet \
    --include=python3,python3-venv,python3-dev,g++,libgomp1,ca-certificates \
    --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$work/rootfs.tar" "$MIRROR"
$PODMAN import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$IMAGE"
echo "base image $IMAGE imported"
