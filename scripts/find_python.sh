#!/usr/bin/env bash
# Print the path of a Python >= 3.12: pyenv's (on our machines), then python3.13/python3.12/python3 on PATH.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
candidates=()
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  # 3.12 first (what .python-version names and the GPU image runs), then newer ones.
  for p in $(ls -d "$root"/versions/3.12*/bin/python "$root"/versions/3.1[3-9]*/bin/python 2>/dev/null); do
    candidates+=("$p")
  done
fi
for name in python3.12 python3.13 python3.14 python3; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
for p in "${candidates[@]}"; do
  if ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: jaxserve needs Python >= 3.12 and none was found (tried pyenv versions, python3.12, python3.13, python3)." >&2
echo "Install one (e.g. 'pyenv install 3.12' or your OS package python3.12) and run make again." >&2
exit 1
