#!/usr/bin/env bash
# Print the path of a working Python >= 3.12 interpreter, or explain and fail.
# Tries $PYTHON, python3.13/python3.12/python3 on PATH, then pyenv-installed versions directly
# (pyenv shims refuse versions that are installed but not selected).
ok() { "$@" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=(python3.12 python3.13 python3.14 python3)
for c in "${candidates[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && ok "$c"; then
    "$c" -c 'import sys; print(sys.executable)'; exit 0
  fi
done
for root in "${PYENV_ROOT:-$HOME/.pyenv}" /root/.pyenv /usr/local/pyenv; do
  for p in "$root"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
done
echo "error: numpyro_blr needs Python >= 3.12 (ArviZ 1.x requires it) and none was found." >&2
echo "       Install one (e.g. 'pyenv install 3.12') or point to it: make test PYTHON=/path/to/python3.12" >&2
exit 1
