//! Networks for tiers with `network = true`, and the check that they cannot reach what the
//! worker protects.
//!
//! A run without a network has a network namespace of its own holding only its own
//! loopback: nothing outside the sandbox answers on any address. A run with a network
//! gets the same namespace plus a user-mode network stack, `slirp4netns`, run as the
//! run's own uid outside the sandbox: the run sees `10.0.2.100/24` behind the gateway
//! `10.0.2.2` and a DNS forwarder at `10.0.2.3`, and its connections leave as ordinary
//! sockets of `slirp4netns` on the host. `--disable-host-loopback` makes the host's
//! loopback (`10.0.2.2`, where the worker's `127.0.0.1` services would appear)
//! unreachable; the run's own `127.0.0.1` is its own namespace's.
//!
//! What that does not stop on its own: a service the host reaches on another address
//! (a database on a LAN, a relay on the internet, a service listening on `0.0.0.0` and so
//! also on the host's own LAN address). So before a worker serves a tier with a network it
//! checks, from inside a real sandbox with a network, every address of every endpoint it
//! knows to protect — the database, the SMTP relay, its node protocol and peers, the API,
//! admin and metrics addresses of its configuration, and `sandbox.protected_endpoints` —
//! each loopback or unspecified address standing for the host's loopback and every
//! address of the host's interfaces. If any of them answers, or the check cannot be run
//! (no `slirp4netns`, no usable `/dev/net/tun`), the worker refuses tiers with a network
//! and says why at start; a task on such a tier fails with that reason. An operator who
//! needs such a tier there blocks the endpoints for the sandbox uids (for example
//! `nft add rule inet filter output meta skuid 900000-900063 ip daddr 10.0.5.0/24 reject`:
//! `slirp4netns` connects as the run's uid) and the check then passes.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use airlock_core::config::Config;
use airlock_core::config::sandbox::Endpoint;

/// Where the host's loopback appears inside a run with a network (blocked).
pub const HOST_ALIAS: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The DNS forwarder inside a run with a network.
pub const DNS: &str = "10.0.2.3";

/// How long the check waits for one connection.
pub const CONNECT_SECONDS: u64 = 3;

/// An endpoint a run with a network must not reach, and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protected {
    pub endpoint: Endpoint,
    pub what: String,
}

/// Host and port of a URL's authority (`scheme://[user[:pass]@]host[:port][/…]`), one per
/// host of a multi-host authority; none for a URL without a host (a Unix socket).
fn url_endpoints(url: &str, default_port: u16) -> Vec<Endpoint> {
    let Some((_, rest)) = url.split_once("://") else { return Vec::new() };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let hosts = authority.rsplit_once('@').map(|(_, h)| h).unwrap_or(authority);
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .filter_map(|h| {
            Endpoint::parse(h).or_else(|| {
                let bare = h.trim_start_matches('[').trim_end_matches(']');
                Endpoint::parse(&format!("[{bare}]:{default_port}"))
            })
        })
        .collect()
}

fn listen(addr: SocketAddr, what: &str) -> Option<Protected> {
    (addr.port() != 0).then(|| Protected {
        endpoint: Endpoint { host: addr.ip().to_string(), port: addr.port() },
        what: what.to_string(),
    })
}

/// Every endpoint the worker's configuration names that a run must not reach.
pub fn protected_endpoints(cfg: &Config) -> Vec<Protected> {
    let mut out = Vec::new();
    let mut add = |endpoint: Endpoint, what: &str| out.push(Protected { endpoint, what: what.to_string() });
    for e in url_endpoints(cfg.database.url.expose(), 5432) {
        add(e, "the database");
    }
    if !cfg.smtp.host.is_empty() && cfg.smtp.port != 0 {
        add(Endpoint { host: cfg.smtp.host.clone(), port: cfg.smtp.port }, "the SMTP relay");
    }
    for (id, peer) in &cfg.nodes {
        for e in url_endpoints(&peer.url, 80) {
            add(e, &format!("node `{id}`"));
        }
    }
    for e in &cfg.sandbox.protected_endpoints {
        add(e.clone(), "a protected endpoint (sandbox.protected_endpoints)");
    }
    out.extend(listen(cfg.api.listen, "the agent API"));
    out.extend(listen(cfg.admin.listen, "the admin API"));
    if cfg.worker.node_id.is_some() {
        out.extend(listen(cfg.worker.node_listen, "this worker's node protocol"));
    }
    if let Some(m) = cfg.worker.metrics_listen {
        out.extend(listen(m, "this worker's health and metrics"));
    }
    out
}

/// The IPv4 addresses of this host's interfaces, loopback excluded.
pub fn host_addresses() -> Vec<Ipv4Addr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    let mut out: Vec<Ipv4Addr> = addrs
        .filter_map(|a| a.address.and_then(|s| s.as_sockaddr_in().map(|v4| v4.ip())))
        .filter(|ip| !ip.is_loopback())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// One address the check tries, and what it stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub addr: SocketAddrV4,
    pub what: String,
}

/// The addresses to try for `protected`: each endpoint resolved; a loopback or
/// unspecified address (a service on this host) becomes the host's loopback as a run
/// sees it and every address of the host's interfaces. IPv6 addresses are left out: a
/// run's network has no IPv6. An endpoint whose name does not resolve is an error (the
/// check cannot show it is out of reach).
pub async fn targets(protected: &[Protected]) -> Result<Vec<Target>, String> {
    let host = host_addresses();
    let mut out = BTreeSet::new();
    for p in protected {
        let e = &p.endpoint;
        let lookup = tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host((e.host.as_str(), e.port)));
        let addrs: Vec<SocketAddr> = match lookup.await {
            Ok(Ok(a)) => a.collect(),
            Ok(Err(err)) => {
                return Err(format!("{} ({e}) does not resolve here ({err}), so it cannot be checked", p.what));
            }
            Err(_) => return Err(format!("{} ({e}) did not resolve within 5 s, so it cannot be checked", p.what)),
        };
        for a in addrs {
            let IpAddr::V4(ip) = a.ip() else { continue };
            let mut add = |ip: Ipv4Addr| {
                out.insert(Target { addr: SocketAddrV4::new(ip, e.port), what: format!("{} ({e})", p.what) });
            };
            if ip.is_loopback() || ip.is_unspecified() || host.contains(&ip) {
                add(HOST_ALIAS);
                host.iter().for_each(|h| add(*h));
            } else {
                add(ip);
            }
        }
    }
    Ok(out.into_iter().collect())
}

/// The check run inside a sandbox with a network (`bash -c SCRIPT check ADDR…`): one
/// `reached ADDR` line per target that accepted a connection, then `checked`.
pub fn probe_script() -> String {
    format!(
        r#"for t in "$@"; do
  ( timeout {CONNECT_SECONDS} bash -c 'exec 3<>"/dev/tcp/${{0%:*}}/${{0##*:}}"' "$t" 2>/dev/null && echo "reached $t" ) &
done
wait
echo checked
"#
    )
}

/// The verdict from the check's output: the first target reached, if any.
pub fn verdict(targets: &[Target], exit_code: Option<i32>, stdout: &str, stderr: &str) -> Result<(), String> {
    if exit_code != Some(0) || stdout.lines().last() != Some("checked") {
        return Err(format!(
            "the reachability check inside a sandbox with a network did not run to its end (exit {exit_code:?}): {}",
            stderr.trim()
        ));
    }
    for line in stdout.lines() {
        if let Some(addr) = line.strip_prefix("reached ") {
            let what = targets.iter().find(|t| t.addr.to_string() == addr).map(|t| t.what.as_str()).unwrap_or("?");
            return Err(format!("a sandbox with a network reached {what} at {addr}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(host: &str, port: u16) -> Endpoint {
        Endpoint { host: host.into(), port }
    }

    #[test]
    fn urls_name_their_hosts() {
        assert_eq!(
            url_endpoints("postgres://u:p@db.internal:6432/x?sslmode=require", 5432),
            vec![ep("db.internal", 6432)]
        );
        assert_eq!(url_endpoints("postgres://127.0.0.1/x", 5432), vec![ep("127.0.0.1", 5432)]);
        assert_eq!(url_endpoints("postgresql://u@[::1]:5433/x", 5432), vec![ep("::1", 5433)]);
        assert_eq!(url_endpoints("postgres://a:5432,b:5433/x", 5432), vec![ep("a", 5432), ep("b", 5433)]);
        assert_eq!(url_endpoints("postgres:///x?host=/run/postgresql", 5432), vec![]);
        assert_eq!(url_endpoints("http://peer:7072", 80), vec![ep("peer", 7072)]);
    }

    #[test]
    fn the_configuration_names_what_it_protects() {
        let vars = [
            ("DATABASE_URL".to_string(), "postgres://u:secret@127.0.0.1:5432/db".to_string()),
            ("AIRLOCK__SMTP__HOST".into(), "relay.example.com".into()),
            ("AIRLOCK__SMTP__PORT".into(), "587".into()),
            ("AIRLOCK__API__LISTEN".into(), "0.0.0.0:7070".into()),
            ("AIRLOCK__ADMIN__LISTEN".into(), "127.0.0.1:0".into()),
            ("AIRLOCK__SANDBOX__PROTECTED_ENDPOINTS".into(), "api:7070".into()),
        ];
        let cfg = Config::from_sources(None, &vars).unwrap();
        let p = protected_endpoints(&cfg);
        let names: Vec<(String, &str)> = p.iter().map(|p| (p.endpoint.to_string(), p.what.as_str())).collect();
        assert!(names.contains(&("127.0.0.1:5432".into(), "the database")), "{names:?}");
        assert!(names.contains(&("relay.example.com:587".into(), "the SMTP relay")), "{names:?}");
        assert!(names.contains(&("0.0.0.0:7070".into(), "the agent API")), "{names:?}");
        assert!(names.iter().any(|(e, _)| e == "api:7070"), "{names:?}");
        assert!(!names.iter().any(|(e, _)| e.ends_with(":0")), "an ephemeral listen address names no port");
        assert!(!format!("{p:?}").contains("secret"), "the database password stays out of it");
    }

    #[tokio::test]
    async fn a_local_service_stands_for_the_host_loopback_and_every_host_address() {
        let t = targets(&[Protected { endpoint: ep("127.0.0.1", 5432), what: "the database".into() }]).await.unwrap();
        let addrs: Vec<String> = t.iter().map(|t| t.addr.to_string()).collect();
        assert!(addrs.contains(&"10.0.2.2:5432".to_string()), "{addrs:?}");
        for h in host_addresses() {
            assert!(addrs.contains(&format!("{h}:5432")), "{addrs:?}");
        }
        let remote = targets(&[Protected { endpoint: ep("192.0.2.77", 25), what: "relay".into() }]).await.unwrap();
        assert_eq!(remote.iter().map(|t| t.addr.to_string()).collect::<Vec<_>>(), vec!["192.0.2.77:25"]);
        assert!(targets(&[Protected { endpoint: ep("no-such-host.invalid", 1), what: "x".into() }]).await.is_err());
    }

    #[test]
    fn the_verdict_names_what_was_reached() {
        let t = vec![Target { addr: "10.0.2.2:5432".parse().unwrap(), what: "the database (127.0.0.1:5432)".into() }];
        assert_eq!(verdict(&t, Some(0), "checked\n", ""), Ok(()));
        let e = verdict(&t, Some(0), "reached 10.0.2.2:5432\nchecked\n", "").unwrap_err();
        assert!(e.contains("the database") && e.contains("10.0.2.2:5432"), "{e}");
        assert!(verdict(&t, Some(127), "", "bash: not found").is_err(), "a check that did not run refuses");
        assert!(verdict(&t, Some(0), "", "").is_err(), "a check cut short refuses");
    }
}
