//! The jobs a worker holds: claimed and not yet ended, running in a slot or waiting in the
//! buffer for one.
//!
//! Invariants:
//! - A job is held from the moment its claim comes back until its handler ends (or it is
//!   dropped from the buffer, or given back on stop). While held, its lease is heartbeated.
//! - Each held job has its own cancellation token. It fires when the heartbeat takes the
//!   lease as lost, or at a hard stop; the job's handler is then abandoned.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use airlock_core::ids::JobId;
use airlock_core::sync::lock;
use airlock_queue::Lease;
use tokio_util::sync::CancellationToken;

/// One held job as the heartbeat sees it.
pub(super) struct Held {
    /// The lease that is extended, and that must still match when a miss is taken as lost.
    pub(super) lease: Lease,
    /// Cancels the job's handler (or keeps it from starting) once its lease is lost.
    pub(super) cancel: CancellationToken,
}

/// The jobs this worker holds, shared by its slots, its heartbeat and its shutdown path.
/// Public so that a test can hold a lease and drive a heartbeat pass over it.
#[derive(Clone, Default)]
pub struct InFlight(Arc<Mutex<HashMap<JobId, Held>>>);

impl InFlight {
    /// Holds `lease` from now on: it is heartbeated, and the token returned is cancelled
    /// when the lease is lost.
    pub fn hold(&self, lease: Lease) -> CancellationToken {
        let cancel = CancellationToken::new();
        lock(&self.0).insert(lease.id(), Held { lease, cancel: cancel.clone() });
        cancel
    }

    /// Stops holding job `id` (it ended, or is given back).
    pub fn remove(&self, id: JobId) {
        lock(&self.0).remove(&id);
    }

    /// How many jobs are held.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The leases held now.
    pub(super) fn leases(&self) -> Vec<Lease> {
        lock(&self.0).values().map(|h| h.lease).collect()
    }

    /// Cancels every held job (the hard stop).
    pub(super) fn cancel_all(&self) {
        for held in lock(&self.0).values() {
            held.cancel.cancel();
        }
    }

    /// The held jobs, locked: for a pass that must see them all at one moment.
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<JobId, Held>> {
        lock(&self.0)
    }
}
