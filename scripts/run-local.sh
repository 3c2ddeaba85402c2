#!/usr/bin/env bash
# Runs the whole MaaS gateway on this machine: PostgreSQL (throwaway), the companion, the model
# simulator and Envoy with the filter (with --replicas N: N Envoys, each with its own companion,
# sharing one Redis). Installs what is missing, builds, waits until everything answers, prints
# READY <gateway URL>… and what to type next. Ctrl-C stops everything.
set -euo pipefail
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() {
  cat <<USAGE
Usage: ./scripts/run-local.sh [--policy FILE] [--identities FILE] [--credentials FILE] [--port N]
                              [--host ADDR] [--replicas N] [--keep] [--observability]

  --policy FILE        tiers, models and each model's backend (simulator or http(s)://host:port)
                       default: config/local/policy.yaml
  --identities FILE    static identities (tokens standing in for OpenShift users)
                       default: config/local/identities.yaml (alice, bob, carol)
  --credentials FILE   provider credentials for external models
                       default: config/local/credentials.yaml
  --port N             gateway port (default 8080, or MAAS_GATEWAY_PORT)
  --host ADDR          gateway listen address (default 127.0.0.1)
  --replicas N         N gateway replicas (Envoy + its own companion each, default 1) sharing
                       one Redis, so limits hold across them; READY lists every gateway URL,
                       the first being the default: READY http://127.0.0.1:8080 http://127.0.0.1:8081
                       (replica i takes port + i when free, else a free port)
  --keep               keep the stack's directory (logs, database) after exit
  --observability      also start Prometheus (port 9090 when free) scraping every Envoy and
                       companion, the shipped alert rules loaded; prints its URL
  -h, --help           this help
USAGE
}

for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage
      exit 0
      ;;
  esac
done

ensure_all
build_all
build_ui
MAAS_UI_DIR="${MAAS_UI_DIR:-$ROOT/ui/dist}" exec "$(target_dir)/debug/maas-local" "$@"
