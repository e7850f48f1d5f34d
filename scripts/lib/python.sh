# The Python test tools (tests/python/requirements.txt) in one virtual environment under
# target/, installed from PyPI when missing or when the requirements changed.
# Source this file, then call `airlock_python_venv`; it exports AIRLOCK_TEST_PYTHON, the
# interpreter the test suites run their Python clients with.

airlock_python_venv() {
  local venv=target/test-venv req=tests/python/requirements.txt
  if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" 2>/dev/null; then
      rm -rf "$venv"
      echo "python: installing python3-venv" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
      python3 -m venv "$venv"
    fi
  fi
  if ! cmp -s "$req" "$venv/.requirements"; then
    echo "python: installing the test tools of $req" >&2
    "$venv/bin/pip" --disable-pip-version-check install --quiet -r "$req" >&2
    cp "$req" "$venv/.requirements"
  fi
  AIRLOCK_TEST_PYTHON="$(cd "$venv/bin" && pwd)/python"
  export AIRLOCK_TEST_PYTHON
}
