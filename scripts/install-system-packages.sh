#!/usr/bin/env bash
# Debian packages the tests need beyond the machine's base image; idempotent and quick when present.
#   lua5.1  runs the Argo CD health check (argocd/) as Argo CD's gopher-lua would (Lua 5.1).
set -euo pipefail

packages=(lua5.1)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
