//! The host uids isolated runs get: one of `sandbox.uid .. sandbox.uid + sandbox.uid_count`
//! per run in progress, never shared by two runs at once on a host.
//!
//! Why a uid per run and not one for all: with user namespaces RLIMIT_NPROC is counted per
//! user namespace *and*, up the chain, per real uid on the host, against the limit the
//! run started with. Each run has a user namespace of its own, so the count inside it is
//! the run's alone; the host-level count of its uid would be every run's together if
//! runs shared a uid, and one run's fork bomb would then stop another's forks. A uid of
//! its own also puts every file a run writes and every process it starts under an owner
//! that no other run and not the worker has: runs cannot signal, trace or read each other
//! even where they could name each other, and after a run ends any process still owned by
//! its uid is a leftover of that run and nothing else.
//!
//! A claim is an abstract Unix socket bound under the uid's name: the kernel refuses a
//! second bind of the name (so two workers on one host, which share the network namespace
//! and the uids, never take the same uid), and releases it when the claim is dropped or
//! its process dies, so a killed worker leaves no stale claim.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How often a run waiting for a free uid looks again.
const RETRY_EVERY: Duration = Duration::from_millis(100);

/// The range of uids runs may take.
#[derive(Debug)]
pub struct UidPool {
    first: u32,
    count: u32,
    /// Where the next search starts, so consecutive runs rotate through the range.
    next: AtomicU32,
}

/// One uid held by one run; released when dropped.
#[derive(Debug)]
pub struct UidClaim {
    pub uid: u32,
    _name: UnixListener,
}

impl UidPool {
    pub fn new(first: u32, count: u32) -> Self {
        Self { first, count: count.max(1), next: AtomicU32::new(0) }
    }

    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last()).contains(&uid)
    }

    pub fn first(&self) -> u32 {
        self.first
    }

    pub fn len(&self) -> u32 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn last(&self) -> u32 {
        self.first + (self.count - 1)
    }

    /// A free uid now, if any.
    pub fn try_claim(&self) -> Option<UidClaim> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..self.count).find_map(|i| {
            let uid = self.first + (start.wrapping_add(i) % self.count);
            let addr = SocketAddr::from_abstract_name(format!("airlock-sandbox-uid-{uid}")).ok()?;
            UnixListener::bind_addr(&addr).ok().map(|l| UidClaim { uid, _name: l })
        })
    }

    /// A free uid, waiting for one while every uid of the range is in use (more runs in
    /// progress on this host than `sandbox.uid_count`). `None` when `cancel` fires first.
    pub async fn claim(&self, cancel: &CancellationToken) -> Option<UidClaim> {
        loop {
            if let Some(c) = self.try_claim() {
                return Some(c);
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(RETRY_EVERY) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_is_held_by_one_claim_at_a_time() {
        // A range of its own, far from the default, so parallel tests do not meet it.
        let pool = UidPool::new(3_000_000_000 + (std::process::id() % 1000) * 4, 2);
        let a = pool.try_claim().unwrap();
        let b = pool.try_claim().unwrap();
        assert_ne!(a.uid, b.uid);
        assert!(pool.contains(a.uid) && pool.contains(b.uid));
        assert!(pool.try_claim().is_none(), "both uids are taken");
        let other = UidPool::new(pool.first, 2);
        assert!(other.try_claim().is_none(), "another pool on the host sees them taken too");
        let freed = a.uid;
        drop(a);
        assert_eq!(pool.try_claim().unwrap().uid, freed);
    }
}
