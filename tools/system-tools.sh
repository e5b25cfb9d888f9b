#!/usr/bin/env bash
# The system tools the tests use, installed from Debian's packages when they are missing (`make test` calls this
# through `make system-tools`). Never fails: where a tool cannot be installed (not Debian, not root and no sudo, no
# network to the package registry), one line says which tools are missing and why, and the tests that need them
# skip, naming them.
#   chromium, chromium-driver  the playground's browser test (tests/test_playground.py)
#   haproxy                    machgen serve --replicas (tests/test_faults.py)
#   prometheus                 promtool tests the rules; machgen serve --prometheus-port (tests/test_deploy.py,
#                              tests/test_faults.py)
#   postgresql                 the API's job store on PostgreSQL (initdb and pg_ctl in a temporary folder)
set -u

postgres_bin() {
    # Debian keeps initdb and pg_ctl under a versioned folder, off PATH.
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
postgres_bin || missing+=(postgresql)
[ "${#missing[@]}" -eq 0 ] && exit 0

skipping="the tests that need them will be SKIPPED"
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-tools: not a Debian machine (no apt-get): ${missing[*]} not installed; $skipping." >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo="sudo -n"
    else
        echo "system-tools: not root and no password-less sudo: ${missing[*]} not installed; $skipping." >&2
        exit 0
    fi
fi
# Debian's packages start their services (PostgreSQL's cluster, Prometheus, HAProxy) where an init system runs; the
# tests start their own, in temporary folders on free ports. So services are kept from starting during the install:
# invoke-rc.d and deb-systemd-invoke ask /usr/sbin/policy-rc.d first, and exit status 101 means "not allowed". A
# policy already there is set aside and put back afterwards; no process that is already running is touched.
policy=/usr/sbin/policy-rc.d
saved="$policy.machgen-saved"
deny_service_starts() {
    [ -e "$policy" ] && [ ! -e "$saved" ] && $sudo mv "$policy" "$saved"
    printf '#!/bin/sh\n# Written by machgen tools/system-tools.sh for the length of one apt-get install.\nexit 101\n' \
        | $sudo tee "$policy" >/dev/null && $sudo chmod 755 "$policy"
}
allow_service_starts() {
    $sudo rm -f "$policy"
    [ -e "$saved" ] && $sudo mv "$saved" "$policy"
    return 0
}

log="$(mktemp)"
if ! $sudo apt-get update -qq >"$log" 2>&1; then
    echo "system-tools: apt-get update failed (no network to the package registry?): ${missing[*]} not" \
         "installed; $skipping. Its last line: $(tail -n 1 "$log")" >&2
else
    trap allow_service_starts EXIT
    trap 'exit 130' INT TERM  # so that the EXIT trap puts the policy back
    deny_service_starts
    if ! $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
            >>"$log" 2>&1; then
        echo "system-tools: apt-get install ${missing[*]} failed; $skipping. Its last line: $(tail -n 1 "$log")" >&2
    else
        echo "system-tools: installed ${missing[*]} for the tests (their services left stopped)."
    fi
    allow_service_starts
    trap - EXIT
fi
rm -f "$log"
exit 0
