#!/usr/bin/env bash
# The real Metaflow UI, locally (optional; never part of `make test`). See infra/README.md.
#
#   infra/ui-local/ui-local.sh up     clone (pinned commits), build, start: PostgreSQL, the
#                                     metadata service (:8080), the UI backend + UI (:8083)
#   infra/ui-local/ui-local.sh down   stop the three processes (the state stays)
#   infra/ui-local/ui-local.sh env    the environment a flow needs to record into this stack
#
# Everything it builds lives in runs/ui-local/ (gitignored, like every run output; `make clean`
# removes it, so `make ui-local-stop` first): the two sources, a Python venv, the database
# cluster, logs and pid files. Not under infra/: tests/infra parses every YAML file below infra/,
# node_modules included. The flows' datastore is the repository's .metaflow/ (DATASTORE below).
# Override the sources with a local mirror or clone:
#   METAFLOW_SERVICE_REPO=/path/to/metaflow-service METAFLOW_UI_REPO=/path/to/metaflow-ui make ui-local
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
STATE="${UI_LOCAL_STATE:-$REPO/runs/ui-local}"
METAFLOW_SERVICE_REPO="${METAFLOW_SERVICE_REPO:-https://github.com/Netflix/metaflow-service.git}"
METAFLOW_UI_REPO="${METAFLOW_UI_REPO:-https://github.com/Netflix/metaflow-ui.git}"
# The commits this was made to work with (infra/README.md); override to try others.
METAFLOW_SERVICE_COMMIT="${METAFLOW_SERVICE_COMMIT:-91e44f0108cba3159db97e91fb159629e1448db1}"
METAFLOW_UI_COMMIT="${METAFLOW_UI_COMMIT:-15e8f04286a1e54993dc64a56f2d4b731a538c25}"
# The UI backend reads artifacts and cards with the Metaflow client: the same version as the
# project's venv, so it reads what the flows write.
METAFLOW_VERSION="${METAFLOW_VERSION:-2.19.39}"
PYTHON="${PYTHON:-python3}"            # metaflow-service's Dockerfiles use Python 3.11
PGPORT="${UI_LOCAL_PGPORT:-5434}"
MD_PORT="${UI_LOCAL_METADATA_PORT:-8080}"
UI_PORT="${UI_LOCAL_UI_PORT:-8083}"
YARN="${YARN:-npx -y yarn@1.22.22}"     # the UI's repo pins its dependencies in yarn.lock

SRC="$STATE/src"; VENV="$STATE/venv"; PGDATA="$STATE/pgdata"; LOGS="$STATE/logs"
# METAFLOW_DATASTORE_SYSROOT_LOCAL of the flows: the repository (its .metaflow/, as a plain local
# run), because Metaflow writes the cards of a local datastore into the first .metaflow/mf.cards
# above the working directory, while the card client (the UI backend) reads <ds-root>/mf.cards:
# the two agree only when the flows run from below the datastore's sysroot. Run flows from $REPO.
DATASTORE="${UI_LOCAL_DATASTORE:-$REPO}"

log() { echo "[ui-local] $*" >&2; }

# PostgreSQL refuses to run as root: then its cluster belongs to the `postgres` user.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
pgbin() {  # initdb/pg_ctl from PATH, else Debian's postgresql package layout
  command -v "$1" 2>/dev/null || ls /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | tail -1
}

db_env() {
  export MF_METADATA_DB_HOST=127.0.0.1 MF_METADATA_DB_PORT="$PGPORT" MF_METADATA_DB_USER=postgres \
    MF_METADATA_DB_PSWD=postgres MF_METADATA_DB_NAME=postgres
}

flow_env() {  # what a flow (and the UI backend's Metaflow client) needs
  cat <<EOF
export METAFLOW_DEFAULT_METADATA=service
export METAFLOW_SERVICE_URL=http://127.0.0.1:$MD_PORT
export METAFLOW_DEFAULT_DATASTORE=local
export METAFLOW_DATASTORE_SYSROOT_LOCAL=$DATASTORE
EOF
}

checkout() {  # checkout <repo url or path> <dir> <commit>
  local repo="$1" dir="$2" commit="$3"
  if [ ! -d "$dir/.git" ]; then
    log "cloning $repo"
    git clone -q "$repo" "$dir"
  fi
  if [ "$(git -C "$dir" rev-parse HEAD)" != "$commit" ]; then
    git -C "$dir" fetch -q origin || true
    git -C "$dir" checkout -q "$commit"
  fi
  log "$(basename "$dir") at $(git -C "$dir" rev-parse HEAD)"
}

venv() {
  if [ ! -f "$VENV/.installed-$METAFLOW_SERVICE_COMMIT" ]; then
    log "venv for the services ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # psycopg2 builds from source: needs gcc and libpq-dev (pg_config)
    "$VENV/bin/pip" install -q -e "$SRC/metaflow-service"
    "$VENV/bin/pip" install -q "metaflow==$METAFLOW_VERSION"
    touch "$VENV/.installed-$METAFLOW_SERVICE_COMMIT"
  fi
}

postgres_up() {
  local initdb pg_ctl; initdb="$(pgbin initdb)"; pg_ctl="$(pgbin pg_ctl)"
  [ -n "$initdb" ] && [ -n "$pg_ctl" ] || { log "no initdb/pg_ctl: apt-get install -y postgresql"; exit 1; }
  mkdir -p "$PGDATA" "$LOGS"
  [ "$(id -u)" = 0 ] && chown postgres: "$PGDATA" "$LOGS" && chmod 700 "$PGDATA"
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    log "initdb $PGDATA"
    local pw; pw="$(mktemp)"; echo postgres > "$pw"; chmod 644 "$pw"
    as_pg "$initdb" -D "$PGDATA" -U postgres --auth=md5 --pwfile="$pw" >/dev/null
    rm -f "$pw"
  fi
  if ! as_pg "$pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    log "starting PostgreSQL on 127.0.0.1:$PGPORT"
    as_pg "$pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w \
      -o "-p $PGPORT -c listen_addresses=127.0.0.1 -k /tmp" start >/dev/null
  fi
}

migrate() {  # the goose migrations of metaflow-service, applied like goose does (see migrate.py)
  db_env
  "$VENV/bin/python" "$HERE/migrate.py" "$SRC/metaflow-service/services/migration_service/migration_files"
}

ui_build() {
  local ui="$SRC/metaflow-ui" dest="$SRC/metaflow-service/services/ui_backend_service/ui"
  if [ ! -f "$ui/build/.commit-$METAFLOW_UI_COMMIT" ]; then
    log "building the UI (yarn install + yarn build: several minutes)"
    (cd "$ui" && CYPRESS_INSTALL_BINARY=0 nice -n 10 $YARN install --frozen-lockfile \
       --network-timeout 1000000 && CI=false GENERATE_SOURCEMAP=false nice -n 10 $YARN build)
    touch "$ui/build/.commit-$METAFLOW_UI_COMMIT"
  fi
  # the UI backend serves services/ui_backend_service/ui/ (UI_ENABLED=1), as its Dockerfile's
  # download_ui.sh would put a release there
  rm -rf "$dest"; cp -r "$ui/build" "$dest"
}

start() {  # start <name> <command...>: in the background, pid in $STATE/<name>.pid
  local name="$1"; shift
  if [ -f "$STATE/$name.pid" ] && kill -0 "$(cat "$STATE/$name.pid")" 2>/dev/null; then
    log "$name already running (pid $(cat "$STATE/$name.pid"))"; return
  fi
  # from $STATE: the UI backend keeps its caches in ./cache_data. In a session of its own, so
  # that `down` can stop it with its cache worker processes (a process group).
  (cd "$STATE" && exec setsid nohup "$@" > "$LOGS/$name.log" 2>&1 < /dev/null) &
  echo $! > "$STATE/$name.pid"
  log "$name started (pid $!, log $LOGS/$name.log)"
}

wait_http() {  # wait_http <url> <seconds>
  local i
  for i in $(seq "$2"); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 1; done
  log "no answer from $1; see $LOGS"; return 1
}

services_up() {
  db_env
  mkdir -p "$DATASTORE"
  eval "$(flow_env)"
  # user for the UI backend's Metaflow client (Metaflow refuses root / no user)
  export METAFLOW_USER="${METAFLOW_USER:-posttrain}"
  MF_METADATA_HOST=127.0.0.1 MF_METADATA_PORT="$MD_PORT" \
    start metadata_service "$VENV/bin/metadata_service"
  wait_http "http://127.0.0.1:$MD_PORT/ping" 60
  # UI_ENABLED=1: the UI backend also serves the built UI (API and UI on one port);
  # cards/artifacts are read from the local datastore above with the Metaflow client.
  MF_UI_METADATA_HOST=127.0.0.1 MF_UI_METADATA_PORT="$UI_PORT" UI_ENABLED=1 \
    PREFETCH_RUNS_SINCE=2592000 PREFETCH_RUNS_LIMIT=5 \
    CACHE_ARTIFACT_MAX_ACTIONS=2 CACHE_DAG_MAX_ACTIONS=2 CACHE_LOG_MAX_ACTIONS=2 \
    CACHE_ARTIFACT_STORAGE_LIMIT=16000000 CACHE_DAG_STORAGE_LIMIT=16000000 \
    MAX_PROCESSABLE_S3_ARTIFACT_SIZE_KB=256 \
    start ui_backend_service "$VENV/bin/ui_backend_service"
  wait_http "http://127.0.0.1:$UI_PORT/ping" 120
}

up() {
  mkdir -p "$SRC" "$LOGS"
  checkout "$METAFLOW_SERVICE_REPO" "$SRC/metaflow-service" "$METAFLOW_SERVICE_COMMIT"
  checkout "$METAFLOW_UI_REPO" "$SRC/metaflow-ui" "$METAFLOW_UI_COMMIT"
  venv
  postgres_up
  migrate
  ui_build
  services_up
  log "Metaflow UI:       http://127.0.0.1:$UI_PORT/"
  log "metadata service:  http://127.0.0.1:$MD_PORT/"
  log "record a flow into it:  eval \"\$($0 env)\"; python flows/pipeline_flow.py run"
  flow_env
}

down() {
  local name
  local name pid i
  for name in ui_backend_service metadata_service; do
    if [ -f "$STATE/$name.pid" ]; then
      pid="$(cat "$STATE/$name.pid")"
      # the UI backend only logs SIGTERM/SIGINT/SIGHUP (ui_server.py's signal handler): SIGKILL
      # its process group after a few seconds
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for i in 1 2 3 4 5; do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      log "stopped $name"
      rm -f "$STATE/$name.pid"
    fi
  done
  if [ -f "$PGDATA/PG_VERSION" ]; then
    as_pg "$(pgbin pg_ctl)" -D "$PGDATA" -m fast stop >/dev/null 2>&1 && log "stopped PostgreSQL" || true
  fi
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  env) flow_env ;;
  *) echo "usage: $0 [up|down|env]" >&2; exit 2 ;;
esac
