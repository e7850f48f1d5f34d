//! Where an outgoing HTTP request may connect: a webhook's host is resolved when the
//! request is made, every address checked, and the connection made only to a checked
//! address (the resolver hook of the HTTP client), so a DNS answer that changes between
//! the allow-list check and the connection (DNS rebinding) cannot point a request inward.
//!
//! Refused unless the receiver's endpoint allows them: loopback (127.0.0.0/8, ::1) with
//! `allow_loopback`; private networks (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7)
//! with `allow_private`. Always refused: "this network" (0/8), link-local (169.254/16,
//! fe80::/10) and the cloud metadata addresses in them, multicast, broadcast, reserved and
//! unspecified addresses. IPv4-mapped IPv6 addresses are judged as the IPv4 address.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

/// What one receiver may resolve to beyond public addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allowance {
    pub loopback: bool,
    pub private: bool,
}

/// Why an address is refused, or `None` when `allow` permits it.
pub fn refusal(ip: IpAddr, allow: Allowance) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refusal_v4(v4, allow),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => refusal_v4(v4, allow),
            None => refusal_v6(v6, allow),
        },
    }
}

/// Cloud metadata services, refused whatever the allowance (they sit in ranges an
/// endpoint may otherwise allow).
const METADATA_V4: [Ipv4Addr; 2] = [Ipv4Addr::new(169, 254, 169, 254), Ipv4Addr::new(100, 100, 100, 200)];
const METADATA_V6: [Ipv6Addr; 1] = [Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)];

fn refusal_v4(ip: Ipv4Addr, allow: Allowance) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if METADATA_V4.contains(&ip) {
        return Some("a cloud metadata address");
    }
    if a == 0 || ip.is_broadcast() || ip.is_multicast() || a >= 240 {
        return Some("a reserved address");
    }
    if ip.is_link_local() {
        return Some("a link-local address");
    }
    if ip.is_loopback() {
        return (!allow.loopback).then_some("a loopback address");
    }
    let shared = a == 100 && (64..128).contains(&b);
    if ip.is_private() || shared {
        return (!allow.private).then_some("a private address");
    }
    None
}

fn refusal_v6(ip: Ipv6Addr, allow: Allowance) -> Option<&'static str> {
    let first = ip.segments()[0];
    if METADATA_V6.contains(&ip) {
        return Some("a cloud metadata address");
    }
    if ip.is_unspecified() || ip.is_multicast() {
        return Some("a reserved address");
    }
    if first & 0xffc0 == 0xfe80 {
        return Some("a link-local address");
    }
    if ip.is_loopback() {
        return (!allow.loopback).then_some("a loopback address");
    }
    if first & 0xfe00 == 0xfc00 {
        return (!allow.private).then_some("a private address");
    }
    None
}

/// The error a refused name or address ends a request with; found again in the request
/// error's causes, so the send is recorded as refused rather than as a lost connection.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{host} resolves to {why} ({ip}), which this endpoint may not reach")]
pub struct AddressRefused {
    pub host: String,
    pub ip: IpAddr,
    pub why: &'static str,
}

/// Finds an [`AddressRefused`] among the causes of `e`.
pub fn refused_in(e: &(dyn std::error::Error + 'static)) -> Option<AddressRefused> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<AddressRefused>() {
            return Some(r.clone());
        }
        cur = err.source();
    }
    None
}

pub type LookupFuture<'a> = Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send + 'a>>;

/// Turns a host name into addresses. The system resolver in production; tests give their
/// own answers (a name that resolves to 127.0.0.1, 10.0.0.1 or 169.254.169.254).
pub trait Lookup: Send + Sync + 'static {
    fn lookup<'a>(&'a self, host: &'a str) -> LookupFuture<'a>;
}

/// The operating system's resolver.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemLookup;

impl Lookup for SystemLookup {
    fn lookup<'a>(&'a self, host: &'a str) -> LookupFuture<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, 0)).await?.map(|a| a.ip()).collect()) })
    }
}

/// A resolver for the HTTP client that answers only addresses `allow` permits; a name
/// with none left fails with [`AddressRefused`].
pub struct GuardedResolver {
    pub lookup: Arc<dyn Lookup>,
    pub allow: Allowance,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (lookup, allow, host) = (self.lookup.clone(), self.allow, name.as_str().to_string());
        Box::pin(async move {
            let ips = lookup.lookup(&host).await?;
            let mut first_refusal = None;
            let mut ok = Vec::new();
            for ip in ips {
                match refusal(ip, allow) {
                    None => ok.push(SocketAddr::new(ip, 0)),
                    Some(why) => {
                        first_refusal.get_or_insert(AddressRefused { host: host.clone(), ip, why });
                    }
                }
            }
            match (ok.is_empty(), first_refusal) {
                (true, Some(refused)) => Err(Box::new(refused) as Box<dyn std::error::Error + Send + Sync>),
                _ => Ok(Box::new(ok.into_iter()) as reqwest::dns::Addrs),
            }
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ranges() {
        let none = Allowance::default();
        let lo = Allowance { loopback: true, private: false };
        let all = Allowance { loopback: true, private: true };
        for public in ["93.184.216.34", "1.1.1.1", "2606:4700::1111", "172.32.0.1", "100.128.0.1"] {
            assert_eq!(refusal(ip(public), none), None, "{public}");
        }
        for (addr, refused_without, allowed_by) in [
            ("127.0.0.1", true, lo),
            ("127.8.9.10", true, lo),
            ("::1", true, lo),
            ("::ffff:127.0.0.1", true, lo),
            ("10.0.0.1", true, all),
            ("172.16.0.1", true, all),
            ("172.31.255.255", true, all),
            ("192.168.1.1", true, all),
            ("100.64.0.1", true, all),
            ("fc00::1", true, all),
            ("fd12::1", true, all),
            ("::ffff:10.0.0.1", true, all),
        ] {
            assert_eq!(refusal(ip(addr), none).is_some(), refused_without, "{addr}");
            assert_eq!(refusal(ip(addr), allowed_by), None, "{addr}");
        }
        assert!(refusal(ip("10.0.0.1"), lo).is_some(), "loopback does not allow private");
        for always in [
            "169.254.169.254",
            "169.254.1.1",
            "100.100.100.200",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "224.0.0.1",
            "240.0.0.1",
            "fe80::1",
            "fd00:ec2::254",
            "::",
            "ff02::1",
            "::ffff:169.254.169.254",
        ] {
            assert!(refusal(ip(always), all).is_some(), "{always}");
        }
    }
}
