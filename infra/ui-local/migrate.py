"""Apply metaflow-service's goose migrations without the goose binary (a Go tool that is on no
Python/npm/Debian registry): each file's `-- +goose Up` section, in version order, recorded in
goose's own `goose_db_version` table so that a later real `goose up` (run_goose.py) sees them as
applied. Statements run in autocommit (psycopg2), one by one, `StatementBegin/End` blocks as one
statement; files marked `-- +goose NO TRANSACTION` (CREATE INDEX CONCURRENTLY) need no transaction
and the others are idempotent (IF NOT EXISTS), so this is safe to rerun.

    MF_METADATA_DB_{HOST,PORT,USER,PSWD,NAME}=... python migrate.py <migration_files dir>
"""
import os
import re
import sys

import psycopg2


def up_statements(text: str) -> list[str]:
    up = text.split("-- +goose Down")[0].split("-- +goose Up", 1)[1]
    statements, block, current = [], None, []
    for line in up.splitlines():
        tag = line.strip()
        if tag == "-- +goose StatementBegin":
            block = []
            continue
        if tag == "-- +goose StatementEnd":
            statements.append("\n".join(block))
            block = None
            continue
        if block is not None:
            block.append(line)
            continue
        if tag.startswith("--") or not tag:
            continue
        current.append(line)
        if tag.endswith(";"):
            statements.append("\n".join(current))
            current = []
    if "".join(current).strip():
        statements.append("\n".join(current))
    return [s for s in statements if s.strip()]


def main(directory: str) -> None:
    env = os.environ
    conn = psycopg2.connect(host=env["MF_METADATA_DB_HOST"], port=env["MF_METADATA_DB_PORT"],
                            user=env["MF_METADATA_DB_USER"], password=env["MF_METADATA_DB_PSWD"],
                            dbname=env["MF_METADATA_DB_NAME"])
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE TABLE IF NOT EXISTS goose_db_version (id serial PRIMARY KEY, "
                "version_id bigint NOT NULL, is_applied boolean NOT NULL, "
                "tstamp timestamp NULL DEFAULT now())")
    cur.execute("SELECT version_id FROM goose_db_version WHERE is_applied")
    applied = {v for (v,) in cur.fetchall()}
    if not applied:
        cur.execute("INSERT INTO goose_db_version (version_id, is_applied) VALUES (0, true)")
    files = sorted((int(re.match(r"(\d+)_", f).group(1)), f)
                   for f in os.listdir(directory) if re.match(r"\d+_.*\.sql$", f))
    for version, name in files:
        if version in applied:
            continue
        for statement in up_statements(open(os.path.join(directory, name)).read()):
            cur.execute(statement)
        cur.execute("INSERT INTO goose_db_version (version_id, is_applied) VALUES (%s, true)",
                    (version,))
        print(f"[ui-local] migration {name} applied", file=sys.stderr)
    print(f"[ui-local] database at version {files[-1][0]}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
