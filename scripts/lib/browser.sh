# The browser suites' tools: Debian's Chromium (driven headless) and playwright-core from
# npm at the version tests/browser/package-lock.json pins. playwright-core never downloads
# a browser; the suites point it at /usr/bin/chromium.
# Source this file, then call `airlock_browser_deps`; it exports AIRLOCK_TEST_CHROMIUM and
# AIRLOCK_TEST_NODE_MODULES, which the browser suites use.

# Installs the npm packages $1/package-lock.json pins into $1/node_modules, unless they are
# already there at that lock.
airlock_npm_ci() {
  local dir=$1
  if ! cmp -s "$dir/package-lock.json" "$dir/node_modules/.package-lock.json.installed"; then
    echo "installing the pinned npm packages of $dir" >&2
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error >&2
    cp "$dir/package-lock.json" "$dir/node_modules/.package-lock.json.installed"
  fi
}

airlock_browser_deps() {
  local missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "browser: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
  local dir=tests/browser
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 airlock_npm_ci "$dir"
  AIRLOCK_TEST_CHROMIUM="$(command -v chromium)"
  AIRLOCK_TEST_NODE_MODULES="$(cd "$dir/node_modules" && pwd)"
  export AIRLOCK_TEST_CHROMIUM AIRLOCK_TEST_NODE_MODULES
}
