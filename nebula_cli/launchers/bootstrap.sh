#!/bin/sh
# nebula's first step on every host: is the interpreter there and recent enough, and does what
# the role needs import? Prints "ok <python version>" and exits 0, or prints ONE line naming the
# host and what is missing (with the fix) on stderr and exits 3.
#
# nebula runs it over the host's transport, fed on stdin (nothing is copied first):
#     sh -s -- WHERE PYTHON MIN_VERSION [MODULE...]
# WHERE        "cluster/host", for the message
# PYTHON       the cluster's `python:` (a name on PATH or a path)
# MIN_VERSION  oldest Python nebula supports, "3.11"
# MODULE       importable modules the role needs (found with importlib.util.find_spec, not
#              imported: a missing package is named in a second, not in a traceback at start)
# The environment is the role's (PATH, PYTHONPATH with nebula's uploaded library, ...).
# POSIX sh only: this runs before anything else on the host is known to work.
set -u
where=$1 python=$2 min=$3
shift 3
fail() { printf 'nebula: %s: %s\n' "$where" "$*" >&2; exit 3; }

if ! command -v "$python" >/dev/null 2>&1; then
    found=""
    for candidate in python3.14 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1; then found=$(command -v "$candidate"); break; fi
    done
    hint="install Python >= $min and set the cluster's \`python:\` to it"
    [ -n "$found" ] && hint="set the cluster's \`python:\` to $found"
    fail "python '$python' not found; $hint"
fi
version=$("$python" -c 'import sys; print("%d.%d.%d" % tuple(sys.version_info[:3]))' 2>/dev/null)
case $version in
    [0-9]*.[0-9]*.[0-9]*) ;;
    *) fail "cannot tell the version of python '$python': it printed '$version'" ;;
esac
major=${version%%.*} rest=${version#*.}
minor=${rest%%.*}
need_major=${min%%.*} need_minor=${min#*.}
if [ "$major" -lt "$need_major" ] || { [ "$major" -eq "$need_major" ] && [ "$minor" -lt "$need_minor" ]; }; then
    fail "'$python' is Python $version; nebula needs Python >= $min: install python$min (or newer) on the host, e.g. \`apt install python$min\` or a conda/uv environment, and set the cluster's \`python:\` to it"
fi
major_minor=$major.$minor
for module in "$@"; do
    if ! "$python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" 2>/dev/null; then
        package=${module%%.*}
        case $package in
            nebula_cli) fail "nebula's runtime ($module) is not importable under '$python' (Python $major_minor): the upload of nebula_cli did not reach PYTHONPATH" ;;
            *) fail "$package is not installed for '$python' (Python $major_minor): pip install $package (or add it to the spec's setup:)" ;;
        esac
    fi
done
echo "ok $version"
