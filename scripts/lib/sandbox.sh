# Prepares this machine for sandboxed tasks as a stock Debian host is: bubblewrap (every
# task isolated in namespaces of its own), slirp4netns (tiers with a network) and a
# /dev/net/tun the sandbox uids may open (Debian's udev rule makes it 0666; some container
# runtimes create it 0600). A worker that runs sandbox jobs refuses to start without
# bubblewrap, and refuses tiers with a network without the other two.
# Source this file, then call `airlock_sandbox_deps`.

airlock_sandbox_deps() {
  local missing=()
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  command -v slirp4netns >/dev/null 2>&1 || missing+=(slirp4netns)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "sandbox: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
  if [ -c /dev/net/tun ] && [ "$(id -u)" = 0 ] && [ "$(stat -c %a /dev/net/tun)" != 666 ]; then
    echo "sandbox: making /dev/net/tun usable by unprivileged users (mode 0666, as on Debian)" >&2
    chmod 0666 /dev/net/tun
  fi
}
