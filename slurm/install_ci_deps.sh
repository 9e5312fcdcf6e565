#!/usr/bin/env bash
# Debian packages for the Slurm tests: slurmctld + slurmd + client commands + munge.
# Idempotent and quiet; needs root (CI runs as root). Does nothing when already installed.
set -euo pipefail
PACKAGES=(slurm-wlm munge)
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm/install_ci_deps.sh: need root to install ${missing[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
