#!/usr/bin/env bash
# A throwaway PostgreSQL server on loopback for the distributed-sweep tests (tests/test_tuner_workers.py).
#
#   eval "$(bash scripts/ci_postgres.sh)"     # exports KVTUNE_TEST_POSTGRES=postgresql://...
#
# Installs PostgreSQL with apt-get when its server binaries are missing (Debian/Ubuntu, as root),
# creates a cluster in a temporary directory (trust auth, 127.0.0.1 only, a free port), starts it
# and prints `export` lines on stdout: the URL, the data directory and the bin directory (stop it
# with "$KVTUNE_TEST_POSTGRES_BIN/pg_ctl" -D "$KVTUNE_TEST_POSTGRES_DIR/data" stop).
# KVTUNE_PG_NO_INSTALL=1 skips the installation (exit 3 when PostgreSQL is missing).
set -euo pipefail
log() { echo "ci_postgres: $*" >&2; }

find_bin() {
    local d
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r) /usr/local/pgsql/bin; do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then echo "$d"; return 0; fi
    done
    if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        dirname "$(readlink -f "$(command -v initdb)")"; return 0
    fi
    return 1
}

bin=$(find_bin || true)
if [ -z "$bin" ]; then
    if [ "${KVTUNE_PG_NO_INSTALL:-0}" = 1 ]; then log "PostgreSQL is not installed"; exit 3; fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "PostgreSQL is not installed and cannot be installed here (needs root and apt-get)"; exit 3
    fi
    log "installing PostgreSQL with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    for attempt in 1 2 3; do
        if apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends postgresql >&2; then break; fi
        [ "$attempt" = 3 ] && { log "apt-get install postgresql failed"; exit 3; }
        sleep $((attempt * 5))
    done
    bin=$(find_bin || true)
    [ -n "$bin" ] || { log "PostgreSQL installed but initdb/pg_ctl not found"; exit 3; }
fi

dir=$(mktemp -d /tmp/kvtune-pg.XXXXXX)
chmod 755 "$dir"
run=()
if [ "$(id -u)" = 0 ]; then                   # initdb and postgres refuse to run as root
    user=postgres
    id -u "$user" >/dev/null 2>&1 || { user=kvtunepg; id -u "$user" >/dev/null 2>&1 || useradd -r -M -s /usr/sbin/nologin "$user"; }
    chown "$user" "$dir"
    if command -v runuser >/dev/null; then run=(runuser -u "$user" --); else run=(su -s /bin/sh "$user" -c); fi
fi
as_user() {
    if [ "${run[0]:-}" = su ]; then "${run[@]}" "$(printf '%q ' "$@")"; else "${run[@]}" "$@"; fi
}

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_user "$bin/initdb" -D "$dir/data" -U kvtune --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; log "initdb failed"; exit 1; }
as_user "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >&2 \
    || { cat "$dir/server.log" >&2; log "pg_ctl start failed"; exit 1; }
url="postgresql://kvtune@127.0.0.1:$port/postgres"
log "PostgreSQL ($bin) running at $url, data in $dir/data"
echo "export KVTUNE_TEST_POSTGRES=$url"
echo "export KVTUNE_TEST_POSTGRES_DIR=$dir"
echo "export KVTUNE_TEST_POSTGRES_BIN=$bin"
