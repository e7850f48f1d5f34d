//! Small helpers for the process-local state that tasks share.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex, ignoring poisoning: the state behind every mutex here stays valid when
/// a task panics while holding it (each change under the lock is a single step).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
